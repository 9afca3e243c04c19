"""The trajectory collector of asynchronous GRPO: a Ray actor that keeps the generator busy.

One thread loops over::

    submit prompt groups (G copies of one prompt, one stream on a generation engine) while
        fewer than ``max_groups_ahead`` groups are out (submitted, not yet used by the trainer)
    -> poll every stream (never blocking on one) -> a finished group is scored by the
       environments in a thread pool -> a scored group waits in ``finished`` for ``take``
    -> a group older than ``max_group_seconds`` (generation or scoring hung) is cancelled and
       its prompt queued again (``requeued_groups``)

The trainer pulls finished groups with ``take``, which also reports the collector's state: an
error that stopped its thread (with the traceback) or the end of its prompts. If the actor
itself dies, the trainer's ``ray.get`` raises at once. So a stalled collector is always
*reported*; nothing ever polls an empty buffer forever.

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

from rl_algorithms.replay_buffer import TrajectoryGroup
from rl_algorithms.rollouts import RolloutResult, _generation_input, run_rollouts
from rl_distributed.batched_data_dict import BatchedDataDict

POLL_SLEEP_SECONDS = 0.02  # between two rounds of polls when nothing arrived


class _Finished:
    """Stands in for the generator inside ``run_rollouts``: the engine already sampled."""

    def __init__(self, out: BatchedDataDict) -> None:
        self.out = out

    def generate(self, data: BatchedDataDict, greedy: bool = False, **_: Any) -> BatchedDataDict:
        if data.size != self.out.size:
            raise RuntimeError(f"{data.size} rows to score, {self.out.size} generated")
        return self.out


@dataclass
class _Group:
    prompt: BatchedDataDict  # one row
    started: float
    worker: Any = None
    stream_id: str | None = None
    samples: dict[int, BatchedDataDict] = field(default_factory=dict)
    scoring: Future | None = None


class TrajectoryCollector:
    """Run as a Ray actor (``CollectorClient`` starts it); every public method is a remote call."""

    def __init__(
        self,
        workers: list[Any],
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
        pending_prompts: list[BatchedDataDict] | None = None,
        groups_out: int = 0,
    ) -> None:
        self.workers = workers  # one per data-parallel engine (its leader)
        self.pad_token_id = pad_token_id
        self.tokenizer, self.template, self.envs = tokenizer, template, envs
        self.loader = loader
        self.group_size = group_size
        self.max_seq_len = max_seq_len
        self.max_epochs = max_epochs
        self.max_group_seconds = max_group_seconds
        self.max_groups_ahead = max_groups_ahead
        self.in_flight_weight_updates = in_flight_weight_updates
        self.retry: deque[BatchedDataDict] = deque(pending_prompts or [])  # before new ones
        self.fresh: deque[BatchedDataDict] = deque()  # rest of the loader's current batch
        self.groups: list[_Group] = []  # generating or scoring
        self.finished: list[TrajectoryGroup] = []  # scored, not yet taken
        self.cond = threading.Condition()
        # Groups submitted and not yet consumed by the trainer (a resumed trainer's buffer
        # holds ``groups_out`` already).
        self.out = groups_out
        self.consumed = 0
        self.requeued = 0
        self.generator_idle_seconds = 0.0
        self.draining = False
        self.out_of_prompts = False
        self.error: str | None = None
        self.stopped = False
        self.next_worker = 0
        self.submitting: BatchedDataDict | None = None  # drawn, its stream not yet started
        self.pool = ThreadPoolExecutor(max_workers=2 * max_groups_ahead + 2)
        self.thread = threading.Thread(target=self._run, name="trajectory-collector", daemon=True)
        self.thread.start()

    # -- what the trainer calls ----------------------------------------------------------------

    def take(self, consumed: int, timeout: float) -> dict[str, Any]:
        """Scored groups since the last call (waits up to ``timeout`` s for one) and the
        collector's state. ``consumed``: groups the trainer has used or dropped in all."""
        with self.cond:
            self.out -= consumed - self.consumed
            self.consumed = consumed
            self.cond.notify_all()
            if not self.finished and self.error is None and not self._exhausted():
                self.cond.wait(timeout)
            groups, self.finished = self.finished, []
            return {
                "groups": groups,
                "error": self.error,
                "exhausted": self._exhausted() and not groups,
                "requeued_groups": self.requeued,
                "generator_idle_seconds": self.generator_idle_seconds,
                "groups_running": len(self.groups),
            }

    def drain(self, timeout: float) -> bool:
        """Stop submitting and wait until no group is generating (a refit without in-flight
        updates); True once drained. ``resume`` lets it go on."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.draining = True
            while any(g.scoring is None for g in self.groups) and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return True

    def resume(self) -> None:
        with self.cond:
            self.draining = False
            self.cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """The loader's position and every prompt drawn but not handed to the trainer."""
        with self.cond:
            pending = [g.prompt for g in self.groups] + [g.prompt for g in self.finished]
            if self.submitting is not None:
                pending.append(self.submitting)
            return {
                "loader": self.loader.state_dict(),
                "pending_prompts": list(self.retry) + list(self.fresh) + pending,
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
                self._cancel_stream(group)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- the loop ------------------------------------------------------------------------------

    def _exhausted(self) -> bool:
        return self.out_of_prompts and not self.groups and not self.retry and not self.fresh

    def _run(self) -> None:
        try:
            last = time.monotonic()
            while not self.stopped:
                self._submit()
                progressed = self._poll()
                self._cancel_overdue()
                now = time.monotonic()
                if not any(g.scoring is None for g in self.groups):
                    self.generator_idle_seconds += now - last
                last = now
                if not progressed:
                    with self.cond:
                        self.cond.wait(POLL_SLEEP_SECONDS)
        except BaseException as err:
            with self.cond:
                self.error = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
                self.cond.notify_all()

    def _next_prompt(self) -> BatchedDataDict | None:
        if self.retry:
            return self.retry.popleft()
        if not self.fresh:
            loader = self.loader
            if loader.position >= len(loader) and loader.epoch + 1 >= self.max_epochs:
                self.out_of_prompts = True
                return None
            batch = next(iter(loader))
            self.fresh.extend(batch.select_indices([i]) for i in range(batch.size))
        return self.fresh.popleft()

    def _submit(self) -> None:
        while not self.draining and self.out < self.max_groups_ahead:
            with self.cond:  # state_dict reads the queues from another thread
                prompt = self.submitting = self._next_prompt()
            if prompt is None:
                return
            group = _Group(prompt, time.monotonic())
            rows = prompt.repeat_interleave(self.group_size)
            logs = list(rows["message_log"])
            if sum(len(m["token_ids"]) for m in logs[0]) >= self.max_seq_len:
                # Too long to generate from: scored as it is (run_rollouts marks it truncated).
                self._score(group, None)
            else:
                data = _generation_input(logs, [None] * len(logs), self.tokenizer.pad_token_id)
                worker = self.workers[self.next_worker % len(self.workers)]
                try:
                    group.stream_id = ray.get(
                        worker.execute.remote("start_stream", (), {"data": data})
                    )
                except ray.exceptions.RayTaskError as err:
                    if type(err.cause).__name__ != "IncompleteRefitError":
                        raise
                    with self.cond:  # a refit is loading weights: try again soon
                        self.retry.appendleft(prompt)
                        self.submitting = None
                    return
                group.worker = worker
                self.next_worker += 1
            with self.cond:
                self.groups.append(group)
                self.submitting = None
                self.out += 1

    def _poll(self) -> bool:
        """Collect finished samples of every generating group; start scoring complete ones."""
        progressed = False
        for group in [g for g in self.groups if g.scoring is None]:
            ready, done = ray.get(
                group.worker.execute.remote(
                    "next_finished", (), {"stream_id": group.stream_id, "timeout": 0}
                )
            )
            group.samples.update(ready)
            progressed |= bool(ready)
            if done:
                out = BatchedDataDict.from_batches(
                    [group.samples[r] for r in range(self.group_size)],
                    pad_value_dict={"output_ids": self.pad_token_id},
                )
                group.stream_id = None
                self._score(group, out)
                with self.cond:
                    self.cond.notify_all()  # a drain may be waiting for this
        for group in [g for g in self.groups if g.scoring is not None and g.scoring.done()]:
            with self.cond:
                self.groups.remove(group)
                self.finished.append(group.scoring.result())
                self.cond.notify_all()
            progressed = True
        return progressed

    def _score(self, group: _Group, out: BatchedDataDict | None) -> None:
        group.scoring = self.pool.submit(self._scored, group, out)

    def _scored(self, group: _Group, out: BatchedDataDict | None) -> TrajectoryGroup:
        rows = group.prompt.repeat_interleave(self.group_size)
        G = self.group_size
        generator = _Finished(out) if out is not None else None
        result: RolloutResult = run_rollouts(
            generator,  # type: ignore[arg-type]
            rows,
            self.tokenizer,
            self.template,
            self.envs,
            max_seq_len=self.max_seq_len,
            max_turns=1,
        )
        if out is None:  # nothing generated: the current weights, by convention
            version = torch.zeros(G, dtype=torch.long)
            vmin = vmax = version
        else:
            vmin = out["weight_version_min"].to(torch.long)
            vmax = out["weight_version_max"].to(torch.long)
        return TrajectoryGroup(
            group.prompt, result, vmin, vmax, seconds=time.monotonic() - group.started
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
                self.retry.append(group.prompt)
                self.out -= 1
                self.requeued += 1
                self.cond.notify_all()

    def _cancel_stream(self, group: _Group) -> None:
        ray.get(group.worker.execute.remote("cancel_stream", (), {"stream_id": group.stream_id}))
        group.stream_id = None


class CollectorError(RuntimeError):
    """The trajectory collector died, stopped on an error, hung, or ran out of prompts."""


class CollectorClient:
    """The trainer's side: starts the collector as a named Ray actor (no CPU of its own: it
    waits on the engines and environments) and turns every way it can fail into a
    ``CollectorError`` naming it and the cause, within seconds."""

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        actor = ray.remote(TrajectoryCollector).options(
            name=name, num_cpus=0, max_concurrency=4, max_restarts=0
        )
        self.name = name
        self.actor = actor.remote(*args, **kwargs)
        self.pid = self.call("pid", timeout=300)

    def describe(self) -> str:
        return f"trajectory collector (Ray actor {self.name!r}, pid {getattr(self, 'pid', '?')})"

    def call(self, method: str, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
        ref = getattr(self.actor, method).remote(*args, **kwargs)
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayActorError as err:
            raise CollectorError(f"the {self.describe()} died: {err}") from err
        except ray.exceptions.GetTimeoutError as err:
            raise CollectorError(
                f"the {self.describe()} did not answer {method} within {timeout:.0f} s"
            ) from err

    def take(self, consumed: int, timeout: float = 1.0) -> dict[str, Any]:
        reply = self.call("take", consumed, timeout, timeout=timeout + 60)
        if reply["error"] is not None:
            raise CollectorError(f"the {self.describe()} stopped: {reply['error']}")
        if reply["exhausted"]:
            raise CollectorError(
                f"the {self.describe()} ran out of prompts (data.train, grpo.max_num_epochs) "
                "before the trainer had enough groups for its next step"
            )
        return reply

    def stop(self) -> None:
        # Already dead or stuck: the kill below is what counts.
        with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            ray.get(self.actor.stop.remote(), timeout=30)
        ray.kill(self.actor)
