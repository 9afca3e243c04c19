"""Arguments of worker-group calls: shape checks for sharded data, and large values shipped
through the object store once instead of once per worker."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import ray

from rl_distributed.worker_host import SharedArg

#: Arguments bigger than this go to the object store once instead of once per worker.
PUT_THRESHOLD_BYTES = 1 << 20


def check_shard_shape(method: str, key: str, value: Any, sizes: list[int]) -> None:
    """Data sharded over axes of sizes [a, b] must be indexable as value[i][j]."""
    for depth, size in enumerate(sizes):
        if not hasattr(value, "__len__") or len(value) != size:
            got = len(value) if hasattr(value, "__len__") else type(value).__name__
            raise ValueError(
                f"{method}: argument {key!r} must have {size} shards at depth {depth} "
                f"(one per coordinate of sharded axis {depth}), got {got}"
            )
        value = value[0]


def _nbytes(value: Any) -> int:
    # torch is optional (the rl-distributed[torch] extra): a tensor exists only if it is loaded.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict) or hasattr(value, "get_dict"):
        return sum(_nbytes(v) for v in value.values())
    return 0


def share_large_values(kwargs: dict[str, Any], copies: int) -> dict[str, Any]:
    """Put big tensors in the object store once so N workers don't get N serialised copies."""
    if copies < 2:
        return kwargs
    return {
        k: SharedArg(ray.put(v)) if _nbytes(v) >= PUT_THRESHOLD_BYTES else v
        for k, v in kwargs.items()
    }
