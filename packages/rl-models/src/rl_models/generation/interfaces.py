"""What the algorithms see of a generator.

``generate`` takes a ``BatchedDataDict`` with

- ``input_ids`` ``[B, S]``: right-padded prompt token ids; ``input_lengths`` ``[B]``;
- ``stop_strings`` (optional): one ``list[str] | None`` per sample, added to the configured ones;

and returns a ``BatchedDataDict`` with

- ``output_ids`` ``[B, S + T]``: prompt followed by response, right-padded with the pad id;
- ``generation_lengths`` ``[B]``: response tokens generated (stop token included if produced);
- ``unpadded_sequence_lengths`` ``[B]``: ``input_lengths + generation_lengths``;
- ``logprobs`` ``[B, S + T]`` float32: each response token's log-prob under the distribution it
  was sampled from (temperature applied, then top-k / top-p truncation and renormalisation);
  greedy rows report the model's own log-prob (temperature 1, untruncated); 0 on prompt tokens
  and padding. Both backends follow this convention;
- ``truncated`` ``[B]`` bool: the response hit ``max_new_tokens`` without stopping;
- ``routed_experts`` ``[B, S + T, layers, k]`` int16, only with
  ``generation.record_routed_experts`` (a mixture-of-experts model, for the policy's router
  replay): per position of ``output_ids`` and per MoE layer (in module order), the ``k``
  experts the router chose when that token went through the model (prompt tokens in the
  prefill); ``-1`` (``moe_routes.NO_ROUTE``) where no token went through: each response's last
  token, never fed back, and padding. The HF backend gives it; see ``GenerationConfig``.
- with ``sampling.first_token_logprobs`` k > 0, ``first_token_top_ids`` ``[B, k]`` (long) and
  ``first_token_top_logprobs`` ``[B, k]`` (float32): the k most likely first response tokens,
  most likely first, and their log-probs under the distribution that token was drawn from.

Weights carry a version: the policy counts its optimiser steps, a refit stamps the version it
copied onto the generator, and ``generate(..., expected_weight_version=v)`` refuses to sample
from any other version (``StaleWeightsError``), so a skipped refit can never go unnoticed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.weight_transfer.buckets import ExportPlan, PackedBucket

if TYPE_CHECKING:
    from rl_models.generation.refit import WeightSync


def check_generate_input(data: BatchedDataDict) -> None:
    """A clear error, naming the key or row, on a malformed ``generate`` batch."""
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise KeyError(f"generate: the batch has no {key!r} (keys: {sorted(data.keys())})")
    ids, lengths = data["input_ids"], data["input_lengths"]
    if ids.ndim != 2 or lengths.shape != (ids.shape[0],):
        raise ValueError(
            f"generate: input_ids must be [B, S] and input_lengths [B]; got "
            f"{tuple(ids.shape)} and {tuple(lengths.shape)}"
        )
    for row, n in enumerate(lengths.tolist()):
        if not 1 <= n <= ids.shape[1]:
            raise ValueError(
                f"generate: row {row} has input_lengths {n}, outside 1..{ids.shape[1]}"
            )


def stop_strings_of(data: BatchedDataDict) -> list[list[str] | None]:
    """Per-row extra stop strings (``data["stop_strings"]``), or ``None`` for every row."""
    if "stop_strings" not in data:
        return [None] * data.size
    per_row = data["stop_strings"]
    if len(per_row) != data.size:
        raise ValueError(
            f"generate: stop_strings has {len(per_row)} entries for a batch of {data.size} rows"
        )
    for row, value in enumerate(per_row):
        if value is not None and not (
            isinstance(value, list | tuple) and all(isinstance(s, str) for s in value)
        ):
            raise TypeError(
                f"generate: stop_strings of row {row} must be a list of str or None, got {value!r}"
            )
    return [None if value is None else list(value) for value in per_row]


class StaleWeightsError(RuntimeError):
    """The generator holds other weights than the controller expects."""

    def __init__(self, loaded: int, expected: int) -> None:
        super().__init__(
            f"generation holds weight version {loaded} but version {expected} was expected: "
            "refit the generator from the policy before generating"
        )
        self.loaded = loaded
        self.expected = expected

    def __reduce__(self):  # crosses process boundaries (Ray) with both versions intact
        return type(self), (self.loaded, self.expected)


class RequestAbortedError(RuntimeError):
    """vLLM finished a request as aborted although nobody cancelled it (an engine-side abort:
    a pause or sleep in ``abort`` mode, a failed KV transfer, ...); its sample is lost."""

    def __init__(self, request_id: str, row: int) -> None:
        super().__init__(
            f"vLLM aborted request {request_id!r} (row {row} of its batch) without a cancel "
            "from the caller: its sample was never finished"
        )
        self.request_id = request_id
        self.row = row

    def __reduce__(self) -> tuple[Any, ...]:  # through Ray with its fields
        return type(self), (self.request_id, self.row)


class IncompleteRefitError(StaleWeightsError):
    """A refit started loading weights but never stamped its version (it failed midway): the
    generator holds a mix of two versions and samples from neither."""

    def __init__(self, loaded: int, expected: int | None = None) -> None:
        RuntimeError.__init__(
            self,
            f"generation weights are a mix of version {loaded} and a newer one: a refit started "
            "loading weights but did not finish (no set_weight_version); refit again before "
            "generating",
        )
        self.loaded = loaded
        self.expected = expected


class GenerationInterface(ABC):
    """A sampler over a worker group, whatever engine runs inside."""

    weight_version: int  # the version of the weights the workers hold now
    # What ``refit`` uses: the group of ``GenerationWorker`` actors and the config
    # (``colocated``, ``refit_bucket_bytes``).
    worker_group: Any
    config: Any
    # How refits reach the workers from a policy, and what lasts between refits (a shared
    # weight region): made by the first ``refit`` (``refit.weight_sync``), released at shutdown.
    weight_sync: WeightSync | None = None

    @abstractmethod
    def generate(
        self,
        data: BatchedDataDict,
        greedy: bool = False,
        *,
        expected_weight_version: int | None = None,
    ) -> BatchedDataDict:
        """Sample one response per row (see the module docstring for keys)."""

    @abstractmethod
    def prepare_for_generation(self) -> None:
        """Wake the engine (load weights / KV cache onto the device) before ``generate``."""

    @abstractmethod
    def finish_generation(self) -> None:
        """Release device memory (weights / KV cache) so a colocated policy can train."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their resources."""


class GenerationWorker(ABC):
    """The methods every generation *worker* (one Ray actor of a generation backend) has.

    ``refit`` (``rl_models.generation.refit``) drives a weight update through these only, so
    any backend (HF, vLLM) that implements them is refit the same way:

    1. ``prepare_for_weight_update()`` on every worker (wake the weights, not the KV cache);
    2. for each bucket the policy exports, in order, on every worker, by channel:
       ``load_weight_bucket(bucket: PackedBucket)`` (object store, the CPU default),
       ``receive_weight_bucket_ipc(bucket: IpcBucket)`` (CUDA IPC), or, after
       ``init_weight_broadcast(host, port, rank, world, backend, key)`` once per refit,
       ``receive_weight_bucket_broadcast(slots, key)`` (NCCL/gloo broadcast);
    3. ``set_weight_version(version)`` on every worker once all buckets are in.

    A backend whose controller sets ``shares_weight_memory = True`` (HF) also offers the
    shared-memory channel (``weight_transfer/shared_memory.py``, the CPU default on one node):
    ``weight_region_layout(specs)`` lays the region out for the policy's export (where the
    worker's parameters keep each tensor), ``map_weight_region(path, layout)`` once (its
    parameters become views of the region; with
    ``path=None`` the worker creates it, and ``unlink_weight_region(path)`` later removes its
    file once every process maps it), then per refit ``prepare_for_weight_update()`` and
    ``commit_weight_region(path, digest, version)`` around the policy's writes.

    ``channels.ChannelReceiver`` implements every step-2 method on top of one method a backend
    writes, ``load_named_weights(named: Iterable[tuple[str, Tensor]])`` (full tensors under
    HF names; a vLLM worker passes them to its model's ``load_weights``).

    A backend whose config has ``loads_lora_adapters`` (HF, vLLM) also takes a LoRA policy's
    adapters instead of its merged weights: ``enable_lora_adapters(lora)`` once (the policy's
    ``LoraConfig`` as a dict), then buckets of adapter tensors (``refit.WeightSync``).

    ``generate(data, greedy, expected_weight_version)`` raises ``StaleWeightsError`` when the
    worker holds another version than the one expected.
    """

    @abstractmethod
    def prepare_for_weight_update(self) -> None:
        """Make the weights writable on the device (e.g. vLLM: wake weights from sleep)."""

    @abstractmethod
    def load_weight_bucket(self, bucket: PackedBucket) -> None:
        """Copy every tensor of ``bucket`` (full tensors under HF names) into the model."""

    @abstractmethod
    def set_weight_version(self, version: int) -> None:
        """Record the policy version the weights now equal (after the last bucket)."""

    @abstractmethod
    def get_weight_version(self) -> int:
        """The version of the weights this worker holds."""


class WeightExportWorker(ABC):
    """The methods a *policy* worker has for streaming its weights out (both backends).

    A collective over the policy's ranks: the controller calls each method on every rank.

    - ``weight_export_plan(bucket_bytes, dtype, lora_export)`` -> ``ExportPlan``: cut the model
      into buckets (each rank of one collective group plans the same number of steps); a LoRA
      policy exports the merged model or the adapters (``policy.lora.LoraExport``);
    - ``export_weight_bucket(step)`` -> ``PackedBucket | None``: gather the full tensors of
      step ``step`` (FSDP2 ``full_tensor``; Megatron tensor-parallel gather + HF conversion) and
      pack them; only ``producer`` ranks return a bucket, the others return ``None``;
    - ``finish_weight_export()`` -> ``dict``: drop the plan; statistics of the export;
    - ``write_weights_to_region(path, layout, bucket_bytes, dtype)`` -> ``dict``: the
      shared-memory channel, every rank writes its part straight into a mapped region
      (``policy.weight_export.WeightExportMethods``), which it mapped with
      ``map_weight_region(path, layout)`` while the region's file still existed, and keeps
      mapped until ``release_weight_region(path)``.
    """

    @abstractmethod
    def weight_export_plan(
        self, bucket_bytes: int, dtype: str | None = None, lora_export: str = "merged"
    ) -> ExportPlan: ...

    @abstractmethod
    def export_weight_bucket(self, step: int) -> PackedBucket | None: ...

    @abstractmethod
    def finish_weight_export(self) -> dict[str, int]: ...
