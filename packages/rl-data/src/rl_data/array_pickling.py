"""Small tensors that cross a process boundary by pickle, sent as numpy arrays.

torch pickles a tensor through its storage, which it writes in ``torch.save``'s legacy format:
about a millisecond a tensor, however small. A numpy array pickles in microseconds. A
conversation holds a tensor or more per message (its token ids, log-probs, loss mask), and an
environment that runs as a Ray actor gets every conversation of a step by pickle, so a step's
call to it paid tens of milliseconds for the tensors alone (``bench/env_call.py``).

``ArrayPickled(value)`` is a one-trip wrapper: pickling it writes ``value`` with its CPU
tensors as arrays, and unpickling gives back the plain ``value`` (not the wrapper), its tensors
rebuilt with their dtype and shape, writable and owning their memory. Lists, tuples and dicts
are walked; anything else is pickled as it is, and so is a tensor numpy cannot hold (bfloat16,
one that is not on the CPU or that requires grad). The records that carry conversations and
scores across processes (an environment's return, a rollout's result) pickle the same way
through ``reduce_with_arrays``.
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


def _pack(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        try:
            return _Array(value.numpy())
        except (TypeError, RuntimeError):  # bfloat16, not on the CPU, requires grad, ...
            return value
    if type(value) is list:
        return [_pack(item) for item in value]
    if type(value) is tuple:
        return tuple(_pack(item) for item in value)
    if type(value) is dict:
        return {key: _pack(item) for key, item in value.items()}
    return value


def _unpack(value: Any) -> Any:
    if isinstance(value, _Array):
        # A copy: an out-of-band buffer (Ray's object store) can be read-only and shared.
        return torch.from_numpy(np.array(value.array, copy=True))
    if type(value) is list:
        return [_unpack(item) for item in value]
    if type(value) is tuple:
        return tuple(_unpack(item) for item in value)
    if type(value) is dict:
        return {key: _unpack(item) for key, item in value.items()}
    return value


class ArrayPickled:
    """``value``, for one trip by pickle with its tensors as arrays (see the module's text)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpack, (_pack(self.value),))


def reduce_with_arrays(obj: Any) -> tuple[Any, ...]:
    """The ``__reduce__`` of a dataclass or named tuple whose fields hold tensors: it is
    rebuilt from its fields (through its constructor), each sent as ``ArrayPickled`` sends a
    value. A checkpoint that pickles it names this module's ``_rebuild``."""
    if dataclasses.is_dataclass(obj):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    else:
        fields = obj._asdict()
    return (_rebuild, (type(obj), _pack(fields)))


def _rebuild(cls: type, fields: dict[str, Any]) -> Any:
    return cls(**_unpack(fields))
