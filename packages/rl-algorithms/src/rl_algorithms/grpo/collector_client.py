"""The trainer's side of the trajectory collector: ``CollectorClient`` starts it as a Ray actor
and turns every way it can fail into a ``CollectorError`` naming it and the cause."""

from __future__ import annotations

import contextlib
from typing import Any

import ray

from rl_algorithms.grpo.collector import TrajectoryCollector
from rl_algorithms.grpo.collector_reply import CollectorReply
from rl_distributed.batched_data_dict import BatchedDataDict

# The loop's heartbeat may be this much older than one engine call's limit before the trainer
# calls the collector stalled (the loop blocks on one engine call at a time, at most).
HEARTBEAT_GRACE_SECONDS = 30.0


class CollectorError(RuntimeError):
    """The trajectory collector died, stopped on an error, hung, or ran out of prompts."""


def check_reply(
    reply: CollectorReply, who: str, heartbeat_timeout: float, lag: int
) -> CollectorReply:
    """``reply`` if the collector (``who``, for the message) is well: its error, a loop that
    has not come round for ``heartbeat_timeout`` s, or (while the trainer waits for its step's
    groups: ``lag`` 0) the end of its prompts raise a ``CollectorError``."""
    if reply.error is not None:
        raise CollectorError(f"the {who} stopped: {reply.error}")
    if reply.heartbeat_age_seconds > heartbeat_timeout:
        raise CollectorError(
            f"the {who} is stalled: its loop has not come round for "
            f"{reply.heartbeat_age_seconds:.0f} s (waiting on {reply.doing})"
        )
    if reply.exhausted and not lag:  # (with lag the trainer has this step's groups)
        raise CollectorError(
            f"the {who} ran out of prompts (data.train, grpo.max_num_epochs) "
            "before the trainer had enough groups for its next step"
        )
    return reply


class CollectorClient:
    """The trainer's side: starts the collector as a named Ray actor (no CPU of its own: it
    waits on the engines and environments), with one method per remote call, and turns every
    way it can fail into a ``CollectorError`` naming it and the cause, within seconds."""

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        actor = ray.remote(TrajectoryCollector).options(
            name=name, num_cpus=0, max_concurrency=4, max_restarts=0
        )
        self.name = name
        self.heartbeat_timeout = kwargs.get("engine_call_seconds", 300.0) + HEARTBEAT_GRACE_SECONDS
        self.actor = actor.remote(*args, **kwargs)
        self.pid: int = self._wait(self.actor.pid.remote(), "pid", timeout=300)

    def describe(self) -> str:
        return f"trajectory collector (Ray actor {self.name!r}, pid {getattr(self, 'pid', '?')})"

    def _wait(self, ref: ray.ObjectRef, method: str, timeout: float) -> Any:
        """The answer of a remote call of ``method``, waited for up to ``timeout`` s."""
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayActorError as err:
            raise CollectorError(f"the {self.describe()} died: {err}") from err
        except ray.exceptions.GetTimeoutError as err:
            raise CollectorError(
                f"the {self.describe()} did not answer {method} within {timeout:.0f} s"
            ) from err

    def take(
        self,
        consumed: int,
        timeout: float = 1.0,
        stale: list[tuple[BatchedDataDict, int]] | None = None,
        lag: int = 0,
    ) -> CollectorReply:
        """``TrajectoryCollector.take``; its error, a stalled loop, or (while the trainer waits
        for its step's groups: ``lag`` 0) the end of its prompts raise here."""
        reply: CollectorReply = self._wait(
            self.actor.take.remote(consumed, timeout, stale, lag), "take", timeout + 60
        )
        return check_reply(reply, self.describe(), self.heartbeat_timeout, lag)

    def drain(self, timeout: float, scoring: bool = False) -> bool:
        """``TrajectoryCollector.drain`` (the call waits a minute longer than the drain)."""
        return self._wait(self.actor.drain.remote(timeout, scoring), "drain", timeout + 60)

    def resume(self) -> None:
        self._wait(self.actor.resume.remote(), "resume", timeout=60)

    def state_dict(self) -> dict[str, Any]:
        """``TrajectoryCollector.state_dict``: the loader's position and the pending prompts."""
        return self._wait(self.actor.state_dict.remote(), "state_dict", timeout=60)

    def stop(self) -> None:
        # Already dead or stuck: the kill below is what counts.
        with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            ray.get(self.actor.stop.remote(), timeout=30)
        ray.kill(self.actor)
