"""What the trajectory collector (``collector.py``) tells the trainer with each ``take``."""

from __future__ import annotations

from dataclasses import dataclass

from rl_algorithms.grpo.replay_buffer import TrajectoryGroup


@dataclass(frozen=True)
class CollectorReply:
    """What ``take`` answers: the groups finished since the last call, and the state."""

    groups: list[TrajectoryGroup]
    error: str | None  # why the collector stopped (an exception with its traceback)
    exhausted: bool  # no prompt left and none generating, none handed over in this reply
    requeued_groups: int  # hung groups cancelled and generated again, so far
    aborted_groups: int  # groups vLLM aborted on its own, generated again
    stale_requeued_groups: int  # groups the trainer dropped as too old, generated again
    filtered_groups: int  # dynamic sampling: groups whose rewards were all equal
    generated_tokens: int  # sampled by the engines for training groups, so far
    discarded_tokens: int  # of those, in groups cancelled or aborted (not trained on)
    generator_idle_seconds: float  # in all, with no turn generating
    groups_running: int  # admitted, not yet finished
    # The engine's weight versions the running groups were admitted under (distinct, sorted):
    # none of a group's tokens is older (one whose turns start after a refit has younger
    # ones, so this errs old). The trainer waits for a group at the last step it can be
    # trained in (``Trajectories.take``).
    running_versions: tuple[int, ...]
    stuck_groups: int  # cancelled, their agent loop's thread still blocked in an env step
    heartbeat_age_seconds: float  # since the loop last came round
    doing: str  # what the loop is waiting on, for a stall report
