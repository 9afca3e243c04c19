"""How the agent loop's turns reach async GRPO's streaming engines.

The agent loop (``agent_loop.run_agent_loop``) asks a ``GenerationInterface`` for turns with a
blocking ``generate``; the engines stream (``StreamingSampler``: start, poll, cancel). In the
trajectory collector each prompt group's agent loop runs in a thread of its own, and its
``generate`` is a ``StreamedGeneration``: it files a ``TurnRequest`` and waits. The collector's
own loop is the only caller of the engines: it starts the requests filed (none while a drain
holds generation back), polls every engine once per round for all of its streams, and hands
each request its samples when the stream is done (or the error that ended it). So a turn that
spans an in-flight refit goes on under the new weights, and every engine call keeps the
collector's deadlines and stall reports.

Environment steps pass an ``EnvironmentGate`` (the agent loop's ``step_gate``): validation
closes it (no training episode is scored while it runs, so the environments' counts stay
validation's own) and waits until no step is running. The agent loop sends each step itself
once let through, so a step's deadline starts there and an actor's late step is cancelled.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.streaming import StreamingSampler


class GroupCancelled(RuntimeError):
    """The collector gave up on the group (past ``max_group_seconds``, or it stopped): the
    turn will never be generated."""


@dataclass(eq=False)  # (compared by identity: a request is found in lists)
class TurnRequest:
    """One ``generate`` call of a group's agent loop: its rows, the engine that serves the
    group, and (once started) its stream; ``reply`` gets the assembled samples or an error."""

    data: BatchedDataDict
    greedy: bool
    sampler: StreamingSampler
    group: Any  # the collector's record of the group that asked
    reply: Future = field(default_factory=Future)
    stream_id: str | None = None
    samples: dict[int, BatchedDataDict] = field(default_factory=dict)


class TurnQueue:
    """The requests of every group, shared by their threads and the collector's loop (under
    the collector's condition ``cond``)."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.waiting: list[TurnRequest] = []  # filed, not started
        self.running: list[TurnRequest] = []  # their stream started, not yet done
        self.closed = False  # the collector stopped: a request filed now would wait forever

    def file(self, request: TurnRequest) -> None:
        with self.cond:
            if self.closed or request.group.abandoned:
                raise GroupCancelled("the collector stopped or gave up on this group")
            self.waiting.append(request)
            self.cond.notify_all()

    def fail(self, requests: list[TurnRequest], error: BaseException) -> None:
        """End ``requests`` with ``error`` (their streams already cancelled, or never started)."""
        with self.cond:
            for request in requests:
                if request in self.waiting:
                    self.waiting.remove(request)
                if request in self.running:
                    self.running.remove(request)
                if not request.reply.done():
                    request.reply.set_exception(error)
            self.cond.notify_all()


class StreamedGeneration:
    """``GenerationInterface.generate`` for one group's agent loop: files the turn with the
    collector and blocks until its stream is done. The rows carry the weight version of each
    sampled token (``generation_versions``) and ``weight_version_min`` / ``_max`` into
    ``Episodes``' per-token tags."""

    def __init__(self, queue: TurnQueue, sampler: StreamingSampler, group: Any) -> None:
        self.queue, self.sampler, self.group = queue, sampler, group

    def generate(
        self,
        data: BatchedDataDict,
        greedy: bool = False,
        expected_weight_version: int | None = None,
    ) -> BatchedDataDict:
        request = TurnRequest(data, greedy, self.sampler, self.group)
        self.group.requests.append(request)
        self.queue.file(request)
        return request.reply.result()


class EnvironmentGate:
    """The agent loops' ``StepGate``: ``closed`` holds new environment steps back (validation);
    ``running()`` counts the steps let through that have not ended nor passed their deadline
    (the agent loop cuts those, and cancels an actor's; a hung one must not stall a drain)."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.closed = False
        self.deadlines: dict[object, float] = {}  # step -> its deadline (inf: none)

    def enter(self, timeout_s: float | None) -> object:
        with self.cond:
            self.cond.wait_for(lambda: not self.closed)
            token = object()
            now = time.monotonic()
            self.deadlines[token] = math.inf if timeout_s is None else now + timeout_s
            return token

    def leave(self, token: object) -> None:
        with self.cond:
            self.deadlines.pop(token, None)
            self.cond.notify_all()

    def running(self) -> int:
        now = time.monotonic()
        with self.cond:
            return sum(deadline > now for deadline in self.deadlines.values())
