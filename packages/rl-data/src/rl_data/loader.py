"""A data loader that can be stopped and resumed exactly.

Its state is the epoch, the number of batches already taken from it, and the random generator
state the epoch's order was drawn from. Restoring that state and iterating yields exactly the
batches an uninterrupted run would have yielded next, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


class StatefulDataLoader:
    """Batches of ``batch_size`` samples, shuffled each epoch by a seeded generator.

    Iterating yields the rest of the current epoch and then moves to the next, so
    ``for batch in loader`` is one epoch and ``next(iter(loader))`` after the end starts a new
    one. ``drop_last`` leaves out a final short batch (every step then has the same size).
    The dataset's ``__getitems__`` is used when it has one, so a batch is processed in one go.
    """

    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] = list,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) < batch_size and drop_last:
            raise ValueError(
                f"dataset has {len(dataset)} samples, fewer than one batch of {batch_size}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.position = 0  # batches already yielded in this epoch
        self._generator = torch.Generator().manual_seed(seed)
        self._start_epoch()

    def _start_epoch(self) -> None:
        # the state at the start of the epoch is what a checkpoint keeps: the order follows from it
        self._epoch_rng_state = self._generator.get_state()
        n = len(self.dataset)
        self._order = (
            torch.randperm(n, generator=self._generator) if self.shuffle else torch.arange(n)
        ).tolist()

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
            self._start_epoch()
        while self.position < len(self):
            start = self.position * self.batch_size
            indices = self._order[start : start + self.batch_size]
            # advance before yielding: a checkpoint taken while this batch is in use resumes after it
            self.position += 1
            yield self.collate_fn(self._fetch(indices))

    def _fetch(self, indices: list[int]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        return list(getitems(indices)) if getitems else [self.dataset[i] for i in indices]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "rng_state": self._epoch_rng_state.tolist(),
            "seed": self.seed,
            "dataset_size": len(self.dataset),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("dataset_size", "batch_size"):
            mine = len(self.dataset) if key == "dataset_size" else self.batch_size
            if state[key] != mine:
                raise ValueError(
                    f"cannot resume: the checkpoint's {key} is {state[key]}, this loader's is {mine}"
                )
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._generator.set_state(torch.tensor(state["rng_state"], dtype=torch.uint8))
        self._start_epoch()
