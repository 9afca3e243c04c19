"""Moved to ``rl_models.weight_transfer.buckets``; this name is kept only until
``generation/vllm/`` imports from there (then delete this module)."""

from rl_models.weight_transfer.buckets import (  # noqa: F401 (the names generation/vllm/ uses)
    PackedBucket,
    TensorSlot,
    pack_bucket,
    unpack_bucket,
)
