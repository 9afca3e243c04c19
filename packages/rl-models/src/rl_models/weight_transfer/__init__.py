"""Moving a policy's weights into a generator: what policies send and generators receive.

``buckets`` (the plan of an export, tensors packed into flat buffers), ``channels`` (CUDA IPC
and broadcast carriers of those buckets) and ``shared_memory`` (a region both sides map). The
policy side (``policy/``, ``megatron/``) and the generator side (``generation/``) both build on
these, so neither imports the other; ``generation.refit`` drives a transfer.
"""
