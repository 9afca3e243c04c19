"""The trajectory collector of asynchronous GRPO: a Ray actor that keeps the generator busy.

One thread loops over::

    submit prompt groups (G copies of one prompt, one stream on a generation engine) while
        fewer than ``max_groups_ahead`` groups are out (submitted, not yet used by the trainer)
    -> poll every stream (never blocking on one) -> a finished group is scored by the
       environments in a thread pool -> a scored group waits in ``finished`` for ``take``
    -> a group older than ``max_group_seconds`` (generation or scoring hung) is cancelled and
       its prompt queued again (``requeued_groups``); so is one vLLM aborted on its own
       (``aborted_groups``) and one the trainer dropped as too stale (``stale_requeued_groups``)
       -- a prompt queued again more than ``max_requeues`` times is an error naming it

The collector sees the engines only through ``rl_models``' typed streaming interface
(``StreamingSampler``: start, poll, cancel, weight version), and scores a finished group with
``rollouts.score_generated``. The trainer pulls finished groups with ``take``, which also
reports the collector's state: an error that stopped its thread (with the traceback), the end
of its prompts, and how long ago its loop last came round (a heartbeat). Every engine call of
the loop waits at most ``engine_call_seconds`` (then the sampler raises, naming the generation
worker, and the loop stops); if the actor itself dies, the trainer's ``ray.get`` raises at
once. So a stalled collector is always
*reported*, within seconds; nothing ever polls an empty buffer forever.

``drain`` (a refit without in-flight updates) and submission share one lock: once a drain has
begun, no generation starts until ``resume``, so the refit never sees a running request.

The collector owns the prompt loader: ``state_dict`` gives its position plus every prompt
drawn but not yet handed to the trainer, so a resumed run loses no prompt.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from rl_algorithms.grpo.replay_buffer import TrajectoryGroup
from rl_algorithms.rollouts import generation_input, score_generated
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.worker_types import WorkerGroupError
from rl_models.generation.interfaces import IncompleteRefitError
from rl_models.generation.streaming import StreamingSampler, StreamNews

POLL_SLEEP_SECONDS = 0.02  # between two rounds of the loop when nothing is generating
# How long a poll waits in the engine for a finished sample when the last round found none:
# it paces the loop while groups generate (a poll is a Ray call, and on a busy core every call
# the engine answers slows its sampling), and bounds how late a new group is submitted.
POLL_WAIT_SECONDS = 0.03
# The loop's heartbeat may be this much older than one engine call's limit before the trainer
# calls the collector stalled (the loop blocks on one engine call at a time, at most).
HEARTBEAT_GRACE_SECONDS = 30.0


def describe_prompt(prompt: BatchedDataDict) -> str:
    """A prompt row as a person finds it again: its index (if the data has one) and text."""
    idx = prompt["idx"][0] if "idx" in prompt else None
    log = prompt["message_log"][0] if "message_log" in prompt else []
    text = " ".join(str(m.get("content", "")) for m in log if m.get("role") == "user")
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"prompt idx={idx} {text!r}" if idx is not None else f"prompt {text!r}"


@dataclass(frozen=True)
class CollectorReply:
    """What ``take`` answers: the groups scored since the last call, and the collector's state."""

    groups: list[TrajectoryGroup]
    error: str | None  # why the collector stopped (an exception with its traceback)
    exhausted: bool  # no prompt left and none generating, none handed over in this reply
    requeued_groups: int  # hung groups cancelled and generated again, so far
    aborted_groups: int  # groups vLLM aborted on its own, generated again
    stale_requeued_groups: int  # groups the trainer dropped as too stale, generated again
    generator_idle_seconds: float  # in all, with no group generating
    groups_running: int  # generating or being scored
    heartbeat_age_seconds: float  # since the loop last came round
    doing: str  # what the loop is waiting on, for a stall report


@dataclass
class _Group:
    prompt: BatchedDataDict  # one row
    started: float
    requeues: int = 0  # times this prompt was queued again before
    sampler: StreamingSampler | None = None
    stream_id: str | None = None
    samples: dict[int, BatchedDataDict] = field(default_factory=dict)
    scoring: Future | None = None


class TrajectoryCollector:
    """Run as a Ray actor (``CollectorClient`` starts it); every public method is a remote call."""

    def __init__(
        self,
        samplers: list[StreamingSampler],
        pad_token_id: int,
        tokenizer: Any,
        template: Any,
        envs: dict[str, Any],
        loader: Any,
        *,
        group_size: int,
        max_seq_len: int,
        max_epochs: int,
        max_group_seconds: float,
        max_groups_ahead: int,
        in_flight_weight_updates: bool,
        engine_call_seconds: float = 300.0,
        max_requeues: int = 3,
        pending_prompts: list[BatchedDataDict] | None = None,
        groups_out: int = 0,
    ) -> None:
        self.samplers = samplers  # one per data-parallel engine; each call has a deadline
        self.engine_call_seconds = engine_call_seconds
        self.max_requeues = max_requeues
        self.pad_token_id = pad_token_id
        self.tokenizer, self.template, self.envs = tokenizer, template, envs
        self.loader = loader
        self.group_size = group_size
        self.max_seq_len = max_seq_len
        self.max_epochs = max_epochs
        self.max_group_seconds = max_group_seconds
        self.max_groups_ahead = max_groups_ahead
        self.in_flight_weight_updates = in_flight_weight_updates
        # Prompts to generate again, before new ones: (prompt, times queued again so far).
        self.retry: deque[tuple[BatchedDataDict, int]] = deque(
            (p, 0) for p in pending_prompts or []
        )
        self.fresh: deque[BatchedDataDict] = deque()  # rest of the loader's current batch
        self.groups: list[_Group] = []  # generating or scoring
        self.finished: list[TrajectoryGroup] = []  # scored, not yet taken
        self.cond = threading.Condition()
        # Groups submitted and not yet consumed by the trainer (a resumed trainer's buffer
        # holds ``groups_out`` already).
        self.out = groups_out
        self.consumed = 0
        self.requeued = 0  # hung groups cancelled
        self.aborted = 0  # groups vLLM aborted without our cancel
        self.stale_requeued = 0  # groups the trainer dropped as too old
        self.generator_idle_seconds = 0.0
        self.draining = False
        self.out_of_prompts = False
        self.error: str | None = None
        self.stopped = False
        self.next_worker = 0
        # Drawn, its stream not yet started (set and cleared under ``cond``: a drain waits for
        # it, and a checkpoint keeps its prompt).
        self.submitting: _Group | None = None
        self.heartbeat = time.monotonic()  # the loop's last round
        self.doing = "starting"  # what the loop is waiting on, for a stall report
        self.pool = ThreadPoolExecutor(max_workers=2 * max_groups_ahead + 2)
        self.thread = threading.Thread(target=self._run, name="trajectory-collector", daemon=True)
        self.thread.start()

    # -- what the trainer calls ----------------------------------------------------------------

    def take(
        self,
        consumed: int,
        timeout: float,
        stale: list[tuple[BatchedDataDict, int]] | None = None,
    ) -> CollectorReply:
        """Scored groups since the last call (waits up to ``timeout`` s for one) and the
        collector's state. ``consumed``: groups the trainer has used or dropped in all;
        ``stale``: the prompts (and their re-queue counts) of groups it dropped as too old,
        generated again."""
        with self.cond:
            self.out -= consumed - self.consumed
            self.consumed = consumed
            for prompt, requeues in stale or []:
                if self._requeue(prompt, requeues, "its group was too stale to train on"):
                    self.stale_requeued += 1
            self.cond.notify_all()
            if not self.finished and self.error is None and not self._exhausted():
                self.cond.wait(timeout)
            groups, self.finished = self.finished, []
            return CollectorReply(
                groups=groups,
                error=self.error,
                exhausted=self._exhausted() and not groups,
                requeued_groups=self.requeued,
                aborted_groups=self.aborted,
                stale_requeued_groups=self.stale_requeued,
                generator_idle_seconds=self.generator_idle_seconds,
                groups_running=len(self.groups),
                heartbeat_age_seconds=time.monotonic() - self.heartbeat,
                doing=self.doing,
            )

    def drain(self, timeout: float, scoring: bool = False) -> bool:
        """Stop submitting and wait until no group is generating or being submitted (a refit
        without in-flight updates) and, with ``scoring``, none is being scored either (so the
        environments see no training sample until ``resume``: validation's metrics stay its
        own); True once drained. Nothing is submitted from then until ``resume``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.draining = True  # _submit checks it under this lock before every submission
            while self._busy(scoring) and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return not self._busy(scoring)

    def _busy(self, scoring: bool) -> bool:
        """A group is generating or being submitted (or, with ``scoring``, being scored)."""
        return self._generating() or (
            scoring and any(g.scoring is not None and not g.scoring.done() for g in self.groups)
        )

    def _generating(self) -> bool:
        return self.submitting is not None or any(g.scoring is None for g in self.groups)

    def resume(self) -> None:
        with self.cond:
            self.draining = False
            self.cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """The loader's position and every prompt drawn but not handed to the trainer."""
        with self.cond:
            pending = [g.prompt for g in self.groups] + [g.prompt for g in self.finished]
            if self.submitting is not None:
                pending.append(self.submitting.prompt)
            return {
                "loader": self.loader.state_dict(),
                "pending_prompts": [p for p, _ in self.retry] + list(self.fresh) + pending,
            }

    def pid(self) -> int:
        import os

        return os.getpid()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout=10)
        for group in self.groups:
            if group.stream_id is not None:
                with contextlib.suppress(WorkerGroupError):
                    self._cancel_stream(group)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- the loop ------------------------------------------------------------------------------

    def _exhausted(self) -> bool:
        return (
            self.out_of_prompts
            and self.submitting is None
            and not self.groups
            and not self.retry
            and not self.fresh
        )

    def _run(self) -> None:
        try:
            last = time.monotonic()
            progressed = True
            while not self.stopped:
                self.heartbeat = time.monotonic()
                self._submit()
                polled = time.monotonic()
                progressed = self._poll(wait=0.0 if progressed else POLL_WAIT_SECONDS)
                self._cancel_overdue()
                now = time.monotonic()
                if not any(g.scoring is None for g in self.groups):
                    self.generator_idle_seconds += now - last
                last = now
                # Nothing new, and the poll did not wait for it (nothing generating, several
                # engines, or one loading weights, which answers at once): pause the loop.
                if not progressed and now - polled < POLL_SLEEP_SECONDS:
                    with self.cond:
                        self.cond.wait(POLL_SLEEP_SECONDS)
        except BaseException as err:
            with self.cond:
                self.error = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
                self.cond.notify_all()

    def _next_prompt(self) -> tuple[BatchedDataDict, int] | None:
        if self.retry:
            return self.retry.popleft()
        if not self.fresh:
            loader = self.loader
            if loader.position >= len(loader) and loader.epoch + 1 >= self.max_epochs:
                self.out_of_prompts = True
                return None
            batch = next(iter(loader))
            self.fresh.extend(batch.select_indices([i]) for i in range(batch.size))
        return self.fresh.popleft(), 0

    def _requeue(self, prompt: BatchedDataDict, requeues: int, why: str) -> bool:
        """Queue a prompt to be generated again (under ``cond``); past ``max_requeues`` the
        collector stops with an error naming it instead. True if queued."""
        if requeues >= self.max_requeues:
            self.error = (
                f"{describe_prompt(prompt)} was already queued again {requeues} times "
                f"(grpo.async_grpo.max_requeues_per_prompt: {self.max_requeues}) and now {why}"
            )
            self.cond.notify_all()
            return False
        self.retry.append((prompt, requeues + 1))
        return True

    def _engine_call(self, sampler: StreamingSampler, what: str, call: Any, *args: Any) -> Any:
        """One call on an engine (its sampler waits at most ``engine_call_seconds`` and raises
        an error naming the worker), recorded for the stall report."""
        self.heartbeat = time.monotonic()  # a beat per call: one call is all the loop waits on
        self.doing = f"{what} on {sampler.name}"
        try:
            return call(*args)
        finally:
            self.doing = "its own loop"

    def _submit(self) -> None:
        while True:
            with self.cond:  # drain and state_dict look at what is being submitted
                if self.stopped or self.draining or self.out >= self.max_groups_ahead:
                    return
                drawn = self._next_prompt()
                if drawn is None:
                    return
                group = self.submitting = _Group(drawn[0], time.monotonic(), drawn[1])
            rows = group.prompt.repeat_interleave(self.group_size)
            logs = list(rows["message_log"])
            sampler = self.samplers[self.next_worker % len(self.samplers)]
            if sum(len(m["token_ids"]) for m in logs[0]) >= self.max_seq_len:
                # Too long to generate from: scored as it is (score_generated marks it
                # truncated), tagged with the weights the engine holds now (no drain waits on it).
                group.sampler = sampler
                version = self._engine_call(sampler, "weight_version", sampler.weight_version)
                self._score(group, None, version)
            else:
                data = generation_input(logs, [None] * len(logs), self.tokenizer.pad_token_id)
                try:
                    group.stream_id = self._engine_call(sampler, "start", sampler.start, data)
                except IncompleteRefitError:
                    with self.cond:  # a refit is loading weights: try again soon
                        self.retry.appendleft(drawn)
                        self.submitting = None
                        self.cond.notify_all()
                    return
                group.sampler = sampler
                self.next_worker += 1
            with self.cond:
                self.groups.append(group)
                self.submitting = None
                self.out += 1
                self.cond.notify_all()

    def _poll(self, wait: float) -> bool:
        """Collect finished samples of every generating group (one call per engine; with a
        single engine the call waits up to ``wait`` s for news, with several none does, so no
        engine's news waits on another's); start scoring complete ones."""
        progressed = False
        by_engine: dict[int, list[_Group]] = {}
        for group in self.groups:
            if group.scoring is None:
                by_engine.setdefault(id(group.sampler), []).append(group)
        wait = wait if len(by_engine) == 1 else 0.0
        for groups in by_engine.values():
            sampler = groups[0].sampler
            ids = [g.stream_id for g in groups]
            news = self._engine_call(sampler, "poll", sampler.poll, ids, wait)
            for group in groups:
                if group.stream_id in news:
                    progressed = True
                    self._take_news(group, news[group.stream_id])
        for group in [g for g in self.groups if g.scoring is not None and g.scoring.done()]:
            with self.cond:
                self.groups.remove(group)
                self.finished.append(group.scoring.result())
                self.cond.notify_all()
            progressed = True
        return progressed

    def _take_news(self, group: _Group, news: StreamNews) -> None:
        """A generating group's new samples (scoring it once complete), or the abort that
        ended its stream."""
        if news.aborted is not None:
            # vLLM aborted a request of the group on its own (the worker cancelled the rest):
            # the group can never finish, so its prompt is generated again.
            group.stream_id = None
            with self.cond:
                self.groups.remove(group)
                self.out -= 1
                if self._requeue(group.prompt, group.requeues, f"vLLM aborted it: {news.aborted}"):
                    self.aborted += 1
                self.cond.notify_all()
            return
        group.samples.update(news.samples)
        if news.done:
            out = BatchedDataDict.from_batches(
                [group.samples[r] for r in range(self.group_size)],
                pad_value_dict={"output_ids": self.pad_token_id},
            )
            group.stream_id = None
            self._score(group, out)
            with self.cond:
                self.cond.notify_all()  # a drain may be waiting for this

    def _score(self, group: _Group, out: BatchedDataDict | None, version: int = 0) -> None:
        group.scoring = self.pool.submit(self._scored, group, out, version)

    def _scored(self, group: _Group, out: BatchedDataDict | None, version: int) -> TrajectoryGroup:
        rows = group.prompt.repeat_interleave(self.group_size)
        G = self.group_size
        result = score_generated(
            rows, out, self.tokenizer, self.template, self.envs, max_seq_len=self.max_seq_len
        )
        if out is None:  # nothing generated: the engine's weights when it was submitted
            vmin = vmax = torch.full((G,), version, dtype=torch.long)
        else:
            vmin = out["weight_version_min"].to(torch.long)
            vmax = out["weight_version_max"].to(torch.long)
        return TrajectoryGroup(
            group.prompt,
            result,
            vmin,
            vmax,
            seconds=time.monotonic() - group.started,
            requeues=group.requeues,
        )

    def _cancel_overdue(self) -> None:
        now = time.monotonic()
        for group in list(self.groups):
            if now - group.started <= self.max_group_seconds:
                continue
            if group.scoring is not None and group.scoring.done():
                continue  # finished in time to be collected next round
            if group.stream_id is not None:
                self._cancel_stream(group)
            # A hung scoring thread is abandoned: its result is never read.
            with self.cond:
                self.groups.remove(group)
                self.out -= 1
                why = f"it ran past max_group_seconds={self.max_group_seconds:.0f}"
                if self._requeue(group.prompt, group.requeues, why):
                    self.requeued += 1
                self.cond.notify_all()

    def _cancel_stream(self, group: _Group) -> None:
        assert group.sampler is not None
        self._engine_call(group.sampler, "cancel", group.sampler.cancel, group.stream_id)
        group.stream_id = None


class CollectorError(RuntimeError):
    """The trajectory collector died, stopped on an error, hung, or ran out of prompts."""


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
    ) -> CollectorReply:
        """``TrajectoryCollector.take``; its error, a stalled loop, or the end of its prompts
        raise here."""
        reply: CollectorReply = self._wait(
            self.actor.take.remote(consumed, timeout, stale), "take", timeout + 60
        )
        if reply.error is not None:
            raise CollectorError(f"the {self.describe()} stopped: {reply.error}")
        if reply.heartbeat_age_seconds > self.heartbeat_timeout:
            raise CollectorError(
                f"the {self.describe()} is stalled: its loop has not come round for "
                f"{reply.heartbeat_age_seconds:.0f} s (waiting on {reply.doing})"
            )
        if reply.exhausted:
            raise CollectorError(
                f"the {self.describe()} ran out of prompts (data.train, grpo.max_num_epochs) "
                "before the trainer had enough groups for its next step"
            )
        return reply

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
