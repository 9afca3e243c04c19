"""``NamedSharding``: worker ranks laid out on a grid with named axes (e.g. ``dp`` x ``tp``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np


def _as_rank_array(layout: Any) -> np.ndarray:
    """``layout`` as an int64 array, or a ValueError saying why it is not a grid of ranks."""
    try:
        array = np.asarray(layout)
    except ValueError as err:  # numpy refuses ragged nesting
        raise ValueError(f"layout must be a rectangular nested list of ranks: {err}") from None
    if array.ndim == 0:
        raise ValueError("layout must have at least one axis, got a scalar")
    if array.size == 0:
        raise ValueError("layout is empty; it must hold at least one rank")
    if array.dtype.kind == "O":
        for entry in array.flat:
            if isinstance(entry, bool | np.bool_) or not isinstance(entry, int | np.integer):
                raise ValueError(f"ranks must be integers, got {entry!r}")
    elif array.dtype.kind not in "iu":
        example = array.flat[0] if array.dtype.kind != "f" else _first_fraction(array)
        raise ValueError(f"ranks must be integers, got {array.dtype} entries such as {example!r}")
    return array.astype(np.int64)


def _first_fraction(array: np.ndarray) -> Any:
    fractional = array[array != np.round(array)]
    return (fractional if fractional.size else array).flat[0].item()


class NamedSharding:
    """Ranks laid out on an N-d grid whose axes have names.

    ``NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])`` puts ranks 0 and 1 in data-parallel group
    0, as tensor-parallel ranks 0 and 1. A sharding built by the constructor must hold each of
    the ranks ``0 .. size-1`` exactly once, so a rank is also an index into the list of workers.
    The sub-shardings that ``get_ranks`` returns keep the original rank numbers, so they hold
    distinct ranks that need not start at 0 or be contiguous.
    """

    def __init__(self, layout: Any, names: Sequence[str]) -> None:
        array = _as_rank_array(layout)
        ranks = sorted(array.ravel().tolist())
        if ranks != list(range(array.size)):
            missing = sorted(set(range(array.size)) - set(ranks))
            unexpected = sorted(set(ranks) - set(range(array.size)))
            duplicated = sorted({r for r, s in itertools.pairwise(ranks) if r == s})
            problems = [
                f"{what} {found}"
                for what, found in [
                    ("duplicate ranks", duplicated),
                    ("missing ranks", missing),
                    ("ranks out of range", unexpected),
                ]
                if found
            ]
            raise ValueError(
                f"layout must hold each rank 0..{array.size - 1} exactly once: "
                + ", ".join(problems)
            )
        self._setup(array, names)

    @classmethod
    def _sub(cls, array: np.ndarray, names: Sequence[str]) -> NamedSharding:
        """A sub-sharding of an already validated one: distinct ranks, not renumbered."""
        sharding = cls.__new__(cls)
        sharding._setup(array.copy(), names)
        return sharding

    def _setup(self, array: np.ndarray, names: Sequence[str]) -> None:
        names = list(names)
        if len(names) != array.ndim:
            raise ValueError(f"layout has {array.ndim} axes but {len(names)} names: {names}")
        if any(not isinstance(name, str) for name in names):
            raise ValueError(f"axis names must be strings, got {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"axis names must be unique, got {names}")
        array.setflags(write=False)  # shared with callers through .layout
        self._layout = array
        self._names = names
        self._coords = {
            int(rank): dict(zip(names, map(int, index), strict=True))
            for index, rank in np.ndenumerate(array)
        }

    @property
    def layout(self) -> np.ndarray:
        """The grid of ranks (read-only)."""
        return self._layout

    @property
    def names(self) -> list[str]:
        """Axis names, in axis order."""
        return list(self._names)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in axis order."""
        return dict(zip(self._names, self._layout.shape, strict=True))

    @property
    def ndim(self) -> int:
        return self._layout.ndim

    @property
    def size(self) -> int:
        """The number of ranks."""
        return int(self._layout.size)

    def get_axis_size(self, name: str) -> int:
        """The size of axis ``name``."""
        return self.shape[self._check_axis(name)]

    def get_worker_coords(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits: axis name -> coordinate."""
        # The type check matters: 1.0 and True hash like 1 and would find rank 1.
        if (
            isinstance(rank, bool)
            or not isinstance(rank, int | np.integer)
            or rank not in self._coords
        ):
            raise ValueError(f"rank {rank!r} is not in {self!r}")
        return dict(self._coords[rank])

    def get_ranks(self, /, **coords: int) -> NamedSharding | int:
        """The ranks at the given coordinates.

        Fixing every axis gives one rank; fixing some gives a ``NamedSharding`` over the others,
        e.g. ``get_ranks(dp=1)`` is data-parallel group 1's tensor-parallel ranks.
        """
        index: list[int | slice] = []
        for name in coords:
            self._check_axis(name)
        for name, size in self.shape.items():
            if name not in coords:
                index.append(slice(None))
                continue
            c = coords[name]
            if isinstance(c, bool) or not isinstance(c, int | np.integer):
                raise ValueError(f"coordinate {name}={c!r} must be an integer")
            if not 0 <= c < size:
                raise ValueError(f"coordinate {name}={c} is out of range for axis size {size}")
            index.append(int(c))
        sub = self._layout[tuple(index)]
        if sub.ndim == 0:
            return int(sub)
        return NamedSharding._sub(sub, [n for n in self._names if n not in coords])

    def _check_axis(self, name: str) -> str:
        if name not in self._names:
            raise ValueError(f"unknown axis {name!r}; the axes are {self._names}")
        return name

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return self._names == other._names and np.array_equal(self._layout, other._layout)

    def __hash__(self) -> int:
        return hash((tuple(self._names), self._layout.shape, self._layout.tobytes()))

    def __repr__(self) -> str:
        return f"NamedSharding(layout={self._layout.tolist()}, names={self._names})"
