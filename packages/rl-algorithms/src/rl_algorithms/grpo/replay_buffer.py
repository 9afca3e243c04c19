"""The replay buffer of asynchronous GRPO: finished prompt groups, tagged with the weight
versions that generated them, waiting for the trainer.

Ages are counted in trainer steps. The policy's ``weight_version`` counts optimiser steps (a
GRPO step may take several), so the buffer keeps the version the policy had at each step
boundary; the generator only ever holds one of those versions (refits happen between steps).
A sample's age at step ``s`` is ``s`` minus the step of the *oldest* version that produced any
of its tokens (with in-flight weight updates a sample's tokens may come from several). A
group is tagged with that step when it enters the buffer, and keeps it through a checkpoint
(the tags do not depend on how the resumed policy numbers its versions).

Staleness is bounded where groups start (the collector admits a group only if it can be
trained on in time), not here: the buffer hands out the groups whose oldest tokens are oldest
first, and drops only a group older than ``max_age_steps`` (async GRPO's
``max_trajectory_span_steps``: a group that ran far longer than the rest), counting its
tokens as discarded work.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from rl_algorithms.rollouts import RolloutResult
from rl_data.array_pickling import reduce_with_arrays, shallow_copy
from rl_distributed.batched_data_dict import BatchedDataDict


@dataclass
class TrajectoryGroup:
    """The G samples of one prompt, scored, with where their tokens came from."""

    prompt: BatchedDataDict  # the prompt's row (to queue it again after a resume)
    result: RolloutResult  # G rows
    version_min: torch.Tensor  # int64 [G]: oldest weight version of each sample's tokens
    version_max: torch.Tensor  # int64 [G]: newest
    seconds: float = 0.0  # from submission to scored
    requeues: int = 0  # times its prompt had been queued again before this group
    # The trainer step of each sample's oldest version (set by ``ReplayBuffer.add``). Ages are
    # kept in steps, which a checkpoint keeps whatever the resumed policy's versions are.
    step_min: torch.Tensor | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # from the collector: its tensors as arrays
        return reduce_with_arrays(self)

    def __copy__(self) -> TrajectoryGroup:
        return shallow_copy(self)

    @property
    def oldest_version(self) -> int:
        return int(self.version_min.min())


class ReplayBuffer:
    """Groups in arrival order; ``take`` hands out the oldest ones young enough to train on."""

    def __init__(self, max_age_steps: int) -> None:
        self.max_age_steps = max_age_steps
        self.groups: list[TrajectoryGroup] = []
        self.steps: list[int] = []  # step boundaries seen, ascending
        self.versions: list[int] = []  # the policy's weight version at each of them
        self.dropped_groups = 0
        self.dropped_samples = 0
        self.dropped_tokens = 0  # generated tokens of the dropped groups
        self.stale: list[TrajectoryGroup] = []  # dropped, not yet handed back (pop_stale)

    def __len__(self) -> int:
        return len(self.groups)

    def record_step(self, step: int, weight_version: int) -> None:
        """The policy holds ``weight_version`` from trainer step ``step`` on."""
        if self.steps and step <= self.steps[-1]:
            if self.versions[self.steps.index(step)] != weight_version:
                raise ValueError(
                    f"step {step} was recorded with weight version "
                    f"{self.versions[self.steps.index(step)]}, now {weight_version}"
                )
            return
        if self.versions and weight_version < self.versions[-1]:
            raise ValueError(
                f"weight version went back from {self.versions[-1]} to {weight_version}"
            )
        self.steps.append(step)
        self.versions.append(weight_version)

    def step_of(self, weight_version: int) -> int:
        """The first trainer step whose weights were ``weight_version`` (the latest step with
        a version not above it: conservative for versions the trainer never recorded)."""
        i = bisect.bisect_right(self.versions, weight_version) - 1
        if i < 0:
            return self.steps[0] if self.steps else 0
        # Several steps may share a version (a step without an optimiser step): the first one.
        return self.steps[self.versions.index(self.versions[i])]

    def ages(self, group: TrajectoryGroup, step: int) -> torch.Tensor:
        """Each sample's age in steps at trainer step ``step``."""
        if group.step_min is None:
            raise ValueError("the group was never added to the buffer (no step tag)")
        return step - group.step_min

    def add(self, groups: list[TrajectoryGroup]) -> None:
        for group in groups:
            group.step_min = torch.tensor([self.step_of(int(v)) for v in group.version_min])
        self.groups.extend(groups)

    def drop_stale(self, step: int) -> int:
        """Drop (and count) every group with a sample older than ``max_age_steps``; they wait
        in ``stale`` until ``pop_stale`` (their prompts are to be generated again)."""
        kept = []
        for group in self.groups:
            if self._too_old(group, step):
                self.dropped_groups += 1
                self.dropped_samples += len(group.version_min)
                self.dropped_tokens += int(group.result.metrics.get("completion_tokens", 0))
                self.stale.append(group)
            else:
                kept.append(group)
        dropped = len(self.groups) - len(kept)
        self.groups = kept
        return dropped

    def pop_stale(self) -> list[TrajectoryGroup]:
        """The groups dropped since the last call."""
        stale, self.stale = self.stale, []
        return stale

    def holds(self, n: int, step: int) -> bool:
        """Whether ``take(n, step)`` would return groups; changes nothing (a stale group
        counts as missing, as ``take`` drops it)."""
        return sum(not self._too_old(g, step) for g in self.groups) >= n

    def _too_old(self, group: TrajectoryGroup, step: int) -> bool:
        return int(self.ages(group, step).max()) > self.max_age_steps

    def take(self, n: int, step: int) -> list[TrajectoryGroup] | None:
        """The ``n`` groups whose oldest tokens are oldest (in arrival order among equals), young
        enough for step ``step`` (stale ones are dropped first), or None if there are fewer."""
        self.drop_stale(step)
        if len(self.groups) < n:
            return None
        order = sorted(range(len(self.groups)), key=lambda i: int(self.groups[i].step_min.min()))  # type: ignore[union-attr]
        chosen = set(order[:n])
        taken = [g for i, g in enumerate(self.groups) if i in chosen]
        self.groups = [g for i, g in enumerate(self.groups) if i not in chosen]
        return taken

    def age_histogram(self, groups: list[TrajectoryGroup], step: int) -> dict[int, int]:
        counts: Counter[int] = Counter()
        for group in groups:
            counts.update(self.ages(group, step).tolist())
        return dict(sorted(counts.items()))

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The groups with their step tags and the counters; the version-to-step map is left
        out: the resumed loop records it again (``record_step``)."""
        return {
            "groups": list(self.groups),
            "dropped_groups": self.dropped_groups,
            "dropped_samples": self.dropped_samples,
            "dropped_tokens": self.dropped_tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = list(state["groups"])
        self.steps, self.versions = [], []
        self.dropped_groups = int(state["dropped_groups"])
        self.dropped_samples = int(state["dropped_samples"])
        self.dropped_tokens = int(state.get("dropped_tokens", 0))  # (older checkpoints)
