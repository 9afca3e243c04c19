"""Small tensors that cross a process boundary by pickle, sent as numpy arrays.

torch pickles a tensor through its storage, which it writes in ``torch.save``'s legacy format:
about a millisecond a tensor, however small. A numpy array pickles in microseconds. A
conversation holds a tensor or more per message (its token ids, log-probs, loss mask), and an
environment that runs as a Ray actor gets every conversation of a step by pickle, so a step's
call to it paid tens of milliseconds for the tensors alone (``bench/env_call.py``).

``ArrayPickled(value)`` is a one-trip wrapper: pickling it writes ``value`` with its CPU
tensors as arrays, and unpickling gives back the plain ``value`` (not the wrapper), its tensors
rebuilt with their dtype and shape, writable and owning their memory. Lists, tuples and dicts
are walked; anything else is pickled as it is (a ``BatchedDataDict``, for one). An object met
twice (the prompt's token ids that a group's conversations share) is sent once and comes back
shared. A tensor travels torch's way when numpy cannot hold it (bfloat16, one not on the CPU
or that requires grad) or when its elements outnumber its storage's (an ``expand``: as an
array it would be sent whole). Tensor subclasses come back as plain tensors, and views of one
storage as separate tensors.

The records that carry conversations and scores across processes (an environment's return, a
rollout's result) pickle the same way through ``reduce_with_arrays``; ``shallow_copy`` keeps
their ``copy.copy`` what it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


class _Array:
    """A tensor on its way, as a numpy array (the marker that tells it from the user's own)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Array, (self.array,))


def _as_array(tensor: torch.Tensor) -> _Array | None:
    try:
        if tensor.numel() * tensor.element_size() > tensor.untyped_storage().nbytes():
            return None  # an expanded tensor: its storage is smaller than its elements
        return _Array(tensor.numpy())
    except (TypeError, RuntimeError, NotImplementedError):  # bfloat16, CUDA, grad, sparse
        return None


def _rebuilt(value: Any, leaf: Any, memo: dict[int, Any]) -> Any:
    """``value`` with ``leaf`` applied to everything in it that is not a list, dict or tuple;
    ``memo`` (by ``id``) keeps what is shared shared, and what refers to itself finite."""
    if id(value) in memo:
        return memo[id(value)]
    # Plain loops, not comprehensions: a frame per level of nesting, as pickle's own, so
    # that data as deep as pickle takes (a dataset's nested metadata) packs too.
    kind = type(value)
    if kind is list:
        out: Any = []
        memo[id(value)] = out
        for item in value:
            out.append(_rebuilt(item, leaf, memo))
    elif kind is dict:
        out = memo[id(value)] = {}
        for key, item in value.items():
            out[key] = _rebuilt(item, leaf, memo)
    elif kind is tuple:
        items = []
        for item in value:
            items.append(_rebuilt(item, leaf, memo))
        out = tuple(items)
    else:
        out = leaf(value)
    memo[id(value)] = out
    return out


def _to_array(value: Any) -> Any:
    return (_as_array(value) or value) if isinstance(value, torch.Tensor) else value


def _to_tensor(value: Any) -> Any:
    if type(value) is not _Array:
        return value
    # A copy: an out-of-band buffer (Ray's object store) can be read-only and shared.
    return torch.from_numpy(np.array(value.array, copy=True))


def _pack(value: Any) -> Any:
    return _rebuilt(value, _to_array, {})


def _restore(packed: Any) -> Any:
    return _rebuilt(packed, _to_tensor, {})


class ArrayPickled:
    """``value``, for one trip by pickle with its tensors as arrays (see the module's text)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (_pack(self.value),))


def _fields(obj: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    return obj._asdict()


def reduce_with_arrays(obj: Any) -> tuple[Any, ...]:
    """The ``__reduce__`` of a dataclass or named tuple whose fields hold tensors: it is
    rebuilt from its fields (through its constructor), each sent as ``ArrayPickled`` sends a
    value. A checkpoint that pickles it names this module's ``_rebuild``."""
    return (_rebuild, (type(obj), _pack(_fields(obj))))


def _rebuild(cls: type, fields: dict[str, Any]) -> Any:
    return cls(**_restore(fields))


def shallow_copy(obj: Any) -> Any:
    """``copy.copy`` of a dataclass or named tuple that pickles through ``reduce_with_arrays``
    (which ``copy`` would otherwise use): a new record holding the same field values."""
    if dataclasses.is_dataclass(obj):
        new = object.__new__(type(obj))
        new.__dict__.update(obj.__dict__)  # (a frozen dataclass's too: no __setattr__ here)
        return new
    return type(obj)(*obj)
