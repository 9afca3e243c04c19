"""The trajectory collector of asynchronous GRPO: a Ray actor that keeps the generator busy.

Each prompt group (G episodes of one prompt) runs in a thread of its own, through sync GRPO's
agent loop (``agent_loop.run_agent_loop``: multi-turn, tools, each episode at its own pace) or
programs calling the collector's OpenAI-compatible endpoint (``agent_program``); its turns (or
requests) are generated on the streaming engines (``turn_streams.StreamedGeneration``).
One thread, the collector's loop, makes every engine call::

    admit groups while the trainer can still train on them in time (below)
    -> start the turns the groups' agent loops asked for (none while a drain holds them)
    -> poll every engine once for all its streams (never blocking on one); a done stream's
       samples go back to the agent loop that waits for them
    -> a group whose agent loop ended is finished (or, with dynamic sampling and rewards all
       equal, filtered: counted, its prompt not generated again)
    -> a group older than ``max_group_seconds`` (generation, a tool or a program hung; time
       drained for a refit or validation left out) is cancelled, its programs' requests
       refused, and its prompt queued again (``requeued_groups``); so is one vLLM aborted on
       its own (``aborted_groups``), and one the trainer dropped as too old to train on
       (``stale_requeued_groups``: it spanned more than ``max_trajectory_span_steps``)

Staleness by admission: a group is started only when, trained after the groups already out
(oldest first), it would be at most ``max_age_steps`` steps old. The trainer says with each
``take`` whether it has taken its current step's groups (``lag``), so the collector knows how
many may be out: ``prompts_per_step * (max_age_steps + 1 - lag)`` (at most
``max_groups_ahead``). A running episode is never thrown away for its age: a refit in flight
lets it go on under the new weights, its tokens tagged with the weights that sampled each,
and the trainer waits for it at its last step (``CollectorReply.running_versions``).

Engines are seen through ``rl_models``' ``StreamingSampler`` (each call waits at most
``engine_call_seconds``). The trainer pulls finished groups with ``take`` (see
``CollectorReply``). ``drain`` (a refit without in-flight updates) holds new turns back until
``resume``; ``drain(scoring=True)`` (validation) holds environment steps back too.
``state_dict``: the loader's position and every prompt drawn but not yet handed over.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rl_algorithms.advantages import groups_with_signal
from rl_algorithms.agent_loop import AgentLoopConfig, run_agent_loop
from rl_algorithms.agent_programs.config import AgentProgramConfig
from rl_algorithms.episodes import group_version_spans
from rl_algorithms.grpo.collector_reply import CollectorReply
from rl_algorithms.grpo.replay_buffer import TrajectoryGroup
from rl_algorithms.grpo.turn_streams import (
    EnvironmentGate,
    GroupCancelled,
    StreamedGeneration,
    TurnQueue,
    TurnRequest,
)
from rl_algorithms.utils.threads import start_thread
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.worker_types import WorkerGroupError
from rl_models.generation.interfaces import IncompleteRefitError, RequestAbortedError
from rl_models.generation.streaming import StreamingSampler, StreamNews

POLL_SLEEP_SECONDS = 0.02  # between two rounds of the loop when nothing is generating
# How long a poll waits in the engine for a finished sample when the last round found none:
# it paces the loop while groups generate (a poll is a Ray call, and on a busy core every call
# the engine answers slows its sampling), and bounds how late a new turn is started.
POLL_WAIT_SECONDS = 0.03


@dataclass(eq=False)
class _Group:
    prompt: BatchedDataDict  # one row
    started: float
    drained_before: float  # the collector's drained seconds when it started (not its age)
    requeues: int = 0  # times this prompt was queued again before
    sampler: StreamingSampler | None = None  # every turn of the group on one engine
    # The engine's version when it was admitted: none of its tokens is older.
    oldest_version: int | None = None
    play: Future | None = None  # its agent loop
    requests: list[TurnRequest] = field(default_factory=list)
    abandoned: bool = False  # cancelled: its agent loop's next turn raises
    halt: Future = field(default_factory=Future)  # gets why, when cancelled: programs stop
    tokens: int = 0  # sampled for it so far


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
        prompts_per_step: int,
        max_age_steps: int,
        in_flight_weight_updates: bool,
        max_turns: int = 1,
        agent_loop: AgentLoopConfig | None = None,
        dynamic_sampling: bool = False,
        agent_program: AgentProgramConfig | None = None,
        sampling: tuple[float, float] = (1.0, 1.0),  # temperature, top_p (the endpoint's)
        engine_call_seconds: float = 300.0,
        pending_prompts: list[BatchedDataDict] | None = None,
        groups_out: int = 0,
    ) -> None:
        self.samplers = samplers  # one per data-parallel engine; each call has a deadline
        self.engine_call_seconds = engine_call_seconds
        self.pad_token_id = pad_token_id
        self.tokenizer, self.template = tokenizer, template
        self.loader = loader
        self.group_size = group_size
        self.max_seq_len = max_seq_len
        self.max_epochs = max_epochs
        self.max_group_seconds = max_group_seconds
        self.max_groups_ahead = max_groups_ahead
        self.prompts_per_step, self.max_age_steps = prompts_per_step, max_age_steps
        self.in_flight_weight_updates = in_flight_weight_updates
        self.max_turns, self.agent_loop = max_turns, agent_loop or AgentLoopConfig()
        self.dynamic_sampling = dynamic_sampling
        self.agent_program, self.sampling = agent_program, sampling
        self.endpoint = None  # the agent programs' (served in this process, on 127.0.0.1)
        if agent_program is not None:
            from rl_algorithms.agent_programs.server import EndpointServer

            self.endpoint = EndpointServer()
        # Prompts to generate again, before new ones: (prompt, times queued again so far).
        self.retry: deque[tuple[BatchedDataDict, int]] = deque(
            (p, 0) for p in pending_prompts or []
        )
        self.fresh: deque[BatchedDataDict] = deque()  # rest of the loader's current batch
        self.groups: list[_Group] = []  # admitted, their agent loop not yet collected
        self.finished: list[TrajectoryGroup] = []  # not yet taken
        self.cond = threading.Condition()
        self.turns = TurnQueue(self.cond)
        self.gate = EnvironmentGate(self.cond)
        self.envs = envs
        # Groups admitted and not yet consumed by the trainer (a resumed trainer's buffer
        # holds ``groups_out`` already); ``lag``: 1 once the trainer took its step's groups.
        self.out = groups_out
        self.consumed = 0
        self.lag = 0
        self.requeued = 0  # hung groups cancelled
        self.aborted = 0  # groups vLLM aborted without our cancel
        self.stale_requeued = 0  # groups the trainer dropped as too old
        self.filtered = 0  # dynamic sampling's groups without a signal
        self.generated_tokens = 0
        self.discarded_tokens = 0
        self.generator_idle_seconds = 0.0
        self.draining = False
        # Seconds spent drained (generation held back) in all, and since when it is now: a
        # group's age leaves them out, or validation would cancel every running group.
        self.drained_seconds = 0.0
        self.drained_since: float | None = None
        self.stuck: list[_Group] = []  # cancelled, their agent loop still in an env step
        self.out_of_prompts = False
        self.error: str | None = None
        self.stopped = False
        self.next_worker = 0
        self.starting: TurnRequest | None = None  # its stream being started (a drain waits)
        self.heartbeat = time.monotonic()  # the loop's last round
        self.doing = "starting"  # what the loop is waiting on, for a stall report
        self.thread = threading.Thread(target=self._run, name="trajectory-collector", daemon=True)
        self.thread.start()

    # -- what the trainer calls ----------------------------------------------------------------

    def take(
        self,
        consumed: int,
        timeout: float,
        stale: list[tuple[BatchedDataDict, int]] | None = None,
        lag: int = 0,
    ) -> CollectorReply:
        """Finished groups since the last call (waits up to ``timeout`` s for one) and the
        collector's state. ``consumed``: groups the trainer has used or dropped in all;
        ``stale``: the prompts (and their re-queue counts) of groups it dropped as too old,
        generated again; ``lag``: 1 when the trainer has taken its current step's groups (the
        generator's weights are a step behind the groups still to take), else 0."""
        with self.cond:
            self.out -= consumed - self.consumed
            self.consumed = consumed
            self.lag = lag
            for prompt, requeues in stale or []:
                self.retry.append((prompt, requeues + 1))
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
                filtered_groups=self.filtered,
                generated_tokens=self.generated_tokens,
                discarded_tokens=self.discarded_tokens,
                generator_idle_seconds=self.generator_idle_seconds,
                groups_running=len(self.groups),
                running_versions=tuple(
                    sorted({g.oldest_version for g in self.groups if g.oldest_version is not None})
                ),
                stuck_groups=self._stuck_groups(),
                heartbeat_age_seconds=time.monotonic() - self.heartbeat,
                doing=self.doing,
            )

    def drain(self, timeout: float, scoring: bool = False) -> bool:
        """Hold every new turn back and wait until no stream is running (a refit without
        in-flight updates) and, with ``scoring``, no environment step either (validation: the
        environments see no training episode until ``resume``); True once drained."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.draining = True  # the loop checks it under this lock before every start
            if self.drained_since is None:
                self.drained_since = time.monotonic()
            self.gate.closed = self.gate.closed or scoring
            while self._busy(scoring) and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return not self._busy(scoring)

    def _busy(self, scoring: bool) -> bool:
        generating = self.starting is not None or bool(self.turns.running)
        return generating or (scoring and self.gate.running() > 0)

    def resume(self) -> None:
        with self.cond:
            self.draining = self.gate.closed = False
            if self.drained_since is not None:
                self.drained_seconds += time.monotonic() - self.drained_since
                self.drained_since = None
            self.cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """The loader's position and every prompt drawn but not handed to the trainer (the
        turns its running episodes finished are not kept: see ``async_loop``)."""
        with self.cond:
            pending = [g.prompt for g in self.groups] + [g.prompt for g in self.finished]
            return {
                "loader": self.loader.state_dict(),
                "pending_prompts": [p for p, _ in self.retry] + list(self.fresh) + pending,
            }

    def pid(self) -> int:
        return os.getpid()

    def requests_in_flight(self) -> dict[str, int]:
        """Turns filed and not yet started, and those whose stream runs (a leak shows here)."""
        with self.cond:
            return {"waiting": len(self.turns.waiting), "running": len(self.turns.running)}

    def stop(self) -> None:
        with self.cond:
            self.stopped = self.turns.closed = True
            self.gate.closed = False  # let a held environment step return
            self.cond.notify_all()
        self.thread.join(timeout=10)
        running = list(self.turns.running)  # (cancelling takes them off that list)
        for request in running:
            with contextlib.suppress(WorkerGroupError):
                self._cancel_stream(request)
        # Each fails, a turn being started too: a waiting agent loop would block the exit.
        starting = [self.starting] if self.starting is not None else []
        pending = self.turns.waiting + running + starting
        self.turns.fail(pending, GroupCancelled("the collector stopped"))
        for group in self.groups:
            self._halt(group, "the collector stopped")
        if self.endpoint is not None:
            self.endpoint.close()

    # -- the loop ------------------------------------------------------------------------------
    def _exhausted(self) -> bool:
        return self.out_of_prompts and not self.groups and not self.retry and not self.fresh

    def _run(self) -> None:
        try:
            last = time.monotonic()
            progressed = True
            while not self.stopped:
                self.heartbeat = time.monotonic()
                self._admit()
                self._start_turns()
                polled = time.monotonic()
                progressed = self._poll(wait=0.0 if progressed else POLL_WAIT_SECONDS)
                progressed = self._collect() or progressed
                self._cancel_overdue()
                now = time.monotonic()
                if not self.turns.running:
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

    def _room(self) -> int:
        """Groups that may still be admitted (under ``cond``): trained after those out, oldest
        first, a new one is at most ``max_age_steps`` steps old."""
        in_time = self.prompts_per_step * (self.max_age_steps + 1 - self.lag)
        return min(in_time, self.max_groups_ahead) - self.out

    def _engine_call(self, sampler: StreamingSampler, what: str, call: Any, *args: Any) -> Any:
        """One call on an engine (its sampler waits at most ``engine_call_seconds`` and raises
        an error naming the worker), recorded for the stall report."""
        self.heartbeat = time.monotonic()  # a beat per call: one call is all the loop waits on
        self.doing = f"{what} on {sampler.name}"
        try:
            return call(*args)
        finally:
            self.doing = "its own loop"

    def _admit(self) -> None:
        # Each engine's version, read once per pass before its groups are listed (a refit
        # meanwhile makes it err old).
        versions: dict[int, int] = {}
        while True:
            with self.cond:
                if self.stopped or self.draining or self._room() <= 0:
                    return
                if self.out_of_prompts and not self.retry and not self.fresh:
                    return  # (no engine call a pass at the end of the prompts)
                sampler = self.samplers[self.next_worker % len(self.samplers)]
            if id(sampler) not in versions:
                versions[id(sampler)] = self._engine_call(
                    sampler, "weight_version", sampler.weight_version
                )
            with self.cond:
                if self.stopped or self.draining or self._room() <= 0:
                    return
                drawn = self._next_prompt()
                if drawn is None:
                    return
                group = _Group(drawn[0], time.monotonic(), self._drained(), drawn[1])
                group.sampler = sampler
                group.oldest_version = versions[id(sampler)]
                self.next_worker += 1
                self.groups.append(group)
                self.out += 1
            # A group cancelled while stuck in an environment step (or its agent programs)
            # keeps its thread, counted in ``stuck_groups``; no later group waits for it.
            group.play = start_thread("trajectory-group", self._play, group)

    def _drained(self) -> float:
        """Seconds spent drained so far (under ``cond``)."""
        now = time.monotonic()
        return self.drained_seconds + (
            0.0 if self.drained_since is None else now - self.drained_since
        )

    def _drained_so_far(self) -> float:
        with self.cond:
            return self._drained()

    def _age(self, group: _Group) -> float:
        """Seconds the group has run, time drained left out (under ``cond``)."""
        return time.monotonic() - group.started - (self._drained() - group.drained_before)

    def _stuck_groups(self) -> int:
        self.stuck = [g for g in self.stuck if g.play is not None and not g.play.done()]
        return len(self.stuck)

    def _play(self, group: _Group) -> TrajectoryGroup:
        """A group's episodes through the agent loop or the agent programs (in its thread)."""
        assert group.sampler is not None
        generation = StreamedGeneration(self.turns, group.sampler, group)
        prompts = group.prompt.repeat_interleave(self.group_size)
        played = (generation, prompts, self.tokenizer, self.template, self.envs)
        # Environment metrics go to the trainer's own call for the groups it trains on.
        common = {"max_seq_len": self.max_seq_len, "with_env_metrics": False}
        if self.agent_program is None:
            result = run_agent_loop(
                *played,
                max_turns=self.max_turns,
                config=self.agent_loop,
                step_gate=self.gate,
                **common,
            )
        else:
            from rl_algorithms.agent_programs.programs import run_program_rollouts

            temperature, top_p = self.sampling
            result = run_program_rollouts(
                self.endpoint,  # type: ignore[arg-type]
                self.agent_program,
                *played,  # type: ignore[arg-type]
                temperature=temperature,
                top_p=top_p,
                stop=group.halt,
                step_gate=self.gate,
                paused_seconds=self._drained_so_far,
                **common,
            )
        assert group.oldest_version is not None and group.sampler is not None  # (admitted)
        vmin, vmax = group_version_spans(
            result.message_logs, group.oldest_version, group.sampler.name
        )
        with self.cond:
            seconds = self._age(group)
        return TrajectoryGroup(
            group.prompt,
            result,
            vmin,
            vmax,
            seconds=seconds,
            requeues=group.requeues,
        )

    def _start_turns(self) -> None:
        while True:
            with self.cond:
                if self.stopped or self.draining or not self.turns.waiting:
                    return
                request = self.starting = self.turns.waiting.pop(0)
            sampler = request.sampler
            try:
                stream = self._engine_call(sampler, "start", sampler.start, request.data)
            except IncompleteRefitError:
                with self.cond:  # a refit is loading weights: try again next round
                    self.turns.waiting.insert(0, request)
                    self.starting = None
                    self.cond.notify_all()
                return
            with self.cond:
                request.stream_id, self.starting = stream, None
                ended = request.reply.done()  # stop() ended it meanwhile: drop its stream
                if not ended:
                    self.turns.running.append(request)
                self.cond.notify_all()
            if ended:
                with contextlib.suppress(WorkerGroupError):
                    self._engine_call(sampler, "cancel", sampler.cancel, stream)

    def _poll(self, wait: float) -> bool:
        """Collect finished samples of every running turn (one call per engine; with a single
        engine the call waits up to ``wait`` s for news, with several none does, so no
        engine's news waits on another's)."""
        progressed = False
        by_engine: dict[int, list[TurnRequest]] = {}
        for request in list(self.turns.running):
            by_engine.setdefault(id(request.sampler), []).append(request)
        wait = wait if len(by_engine) == 1 else 0.0
        for requests in by_engine.values():
            sampler = requests[0].sampler
            ids = [r.stream_id for r in requests]
            news = self._engine_call(sampler, "poll", sampler.poll, ids, wait)
            for request in requests:
                if request.stream_id in news:
                    progressed = True
                    self._take_news(request, news[request.stream_id])
        return progressed

    def _take_news(self, request: TurnRequest, news: StreamNews) -> None:
        """A running turn's new samples (handed to its agent loop once complete), or the
        abort that ended its stream (raised in its agent loop)."""
        if news.aborted is not None:
            request.stream_id = None
            self.turns.fail([request], news.aborted)
            return
        request.samples.update(news.samples)
        if news.done:
            out = BatchedDataDict.from_batches(
                [request.samples[r] for r in range(request.data.size)],
                pad_value_dict={"output_ids": self.pad_token_id, "generation_versions": -1},
            )
            tokens = int(out["generation_lengths"].sum())
            with self.cond:
                self.generated_tokens += tokens
                request.group.tokens += tokens
                request.stream_id = None
                self.turns.running.remove(request)
                request.reply.set_result(out)
                self.cond.notify_all()  # a drain may be waiting for this

    def _collect(self) -> bool:
        """Groups whose agent loop ended: finished, filtered, or (vLLM aborted a turn) queued
        again; any other error of an agent loop stops the collector."""
        done = [g for g in self.groups if g.play is not None and g.play.done()]
        for group in done:
            assert group.play is not None
            error = group.play.exception()
            with self.cond:
                self.groups.remove(group)
                if error is None:
                    finished: TrajectoryGroup = group.play.result()
                    if self.dynamic_sampling and not self._has_signal(finished):
                        self.filtered += 1
                        self.out -= 1
                    else:
                        self.finished.append(finished)
                elif isinstance(error, RequestAbortedError):
                    # vLLM aborted a request of the group on its own: its prompt starts again.
                    self.aborted += 1
                    self._discard(group)
                else:
                    raise error
                self.cond.notify_all()
        return bool(done)

    def _has_signal(self, group: TrajectoryGroup) -> bool:
        return bool(groups_with_signal(group.result.rewards, self.group_size).all())

    def _discard(self, group: _Group) -> None:
        """Give up on an admitted group (under ``cond``): its prompt is queued again."""
        self.out -= 1
        self.discarded_tokens += group.tokens
        self.retry.append((group.prompt, group.requeues + 1))

    def _cancel_overdue(self) -> None:
        for group in list(self.groups):
            with self.cond:
                age = self._age(group)
            if age <= self.max_group_seconds:
                continue
            if group.play is not None and group.play.done():
                continue  # finished in time to be collected next round
            with self.cond:  # (``TurnQueue.file`` reads it under the lock)
                group.abandoned = True
            for request in [r for r in group.requests if r.stream_id is not None]:
                self._cancel_stream(request)
            why = f"it ran past max_group_seconds={self.max_group_seconds:g}"
            self.turns.fail(group.requests, GroupCancelled(why))
            self._halt(group, why)
            # An agent loop stuck in an environment step is abandoned: its result is never read.
            with self.cond:
                self.groups.remove(group)
                self.stuck.append(group)  # (until its agent loop ends)
                self.requeued += 1
                self._discard(group)
                self.cond.notify_all()

    def _halt(self, group: _Group, why: str) -> None:
        """Stop the group's agent programs, if any: their rollout raises ``GroupCancelled``."""
        with self.cond:
            if not group.halt.done():
                group.halt.set_exception(GroupCancelled(why))

    def _cancel_stream(self, request: TurnRequest) -> None:
        sampler, stream = request.sampler, request.stream_id
        request.stream_id = None
        with self.cond:
            if request in self.turns.running:
                self.turns.running.remove(request)
        self._engine_call(sampler, "cancel", sampler.cancel, stream)
