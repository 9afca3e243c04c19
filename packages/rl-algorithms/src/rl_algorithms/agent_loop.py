"""The agent loop: every episode of a rollout goes on as soon as its own calls return.

A lockstep rollout waits, each turn, for the slowest sample's generation and the slowest
environment step before any sample goes on: with tools whose latency varies (a program that
runs 2 s, a search that returns at once) the batch runs at the pace of its slowest call. Here
the driver runs one event loop over futures instead:

- an episode that needs a turn waits in a queue; whenever a generation slot is free (at most
  ``max_concurrent_generations`` generate calls in flight), every waiting episode goes into one
  generate call (``GenerationInterface.generate``: HF or vLLM, run in a thread, as it blocks on
  the workers);
- when a call returns, each of its episodes takes its response (token in, token out:
  ``Episodes.add_response``) and its environment step is issued at once: the episodes of one
  environment together (``env_steps: batched``) or each on its own call (``per_episode``).
  By default (``auto``) an environment that serves concurrent steps (its class's
  ``concurrent_steps``, as the tool environment's does) gets a call per episode, and any
  other environment one call per generate call's episodes;
- when a step returns, its episodes are scored and either end or get the environment's reply
  and go back into the queue, without waiting for any other episode.

Environments that are Ray actors are called with ``step.remote``; in-process ones (tests,
benchmarks) in threads: one per environment stepped in batches (calls to it run one at a time,
as on an actor with the default ``max_concurrency``), several per environment stepped per
episode.

Limits per episode: ``max_turns``, ``max_seq_len`` (its total tokens), ``max_tool_calls``,
``max_episode_seconds`` (checked between turns: an episode past it starts no new turn) and
``env_step_timeout_s`` (a step that takes longer ends its episodes, ``env_timeout``; an
actor's step is cancelled then, see ``_cut_late_steps``). How each episode ended is in
``RolloutResult.end_reasons``.

Sampling seeds: a generator that seeds its rows (``rl_models.generation.seeds``) numbers them
by their place in a call, and which episodes share a call depends on timing here. So the loop
takes one call's seeds for the rollout (episode ``i``'s base seed) and gives each turn its own
seed from the episode and turn alone: whatever the timing, a turn is sampled with the same
seed in a resumed run. (Its tokens are the same too where the engine's numerics do not depend
on what else is in the batch, as on CPU; time limits depend on timing whatever the seeds.)
Turn 0 uses the base seed itself: a single-turn rollout samples what the lockstep loop
samples.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import ray
import torch
from pydantic import Field

from rl_algorithms.environment_calls import (
    resolve_env_call,
    rows_by_task,
    serves_concurrent_steps,
    split_steps,
    step_remote,
)
from rl_algorithms.episodes import (
    ENV_TIMEOUT,
    TIME_LIMIT,
    TOOL_CALL_LIMIT,
    TURN_LIMIT,
    Episodes,
)
from rl_algorithms.rollout_result import RolloutResult
from rl_data.templates import ChatTemplate
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.config import ConfigModel
from rl_models.generation.interfaces import GenerationInterface
from rl_models.generation.seeds import SEEDS_KEY, SamplingSeeds
from rl_models.modeling.random_streams import row_seed

# Threads for the concurrent calls of an in-process environment stepped per episode.
MAX_ENV_THREADS = 64


class AgentLoopConfig(ConfigModel):
    """How the agent loop runs episodes (``grpo.agent_loop``, and PPO's and distillation's)."""

    # Generate calls in flight at once, each taking every episode waiting for a turn when it
    # starts. The generation workers (Ray actors) serve one call at a time: a second call in
    # flight queues behind the first, so that its batch starts the moment the workers are free.
    max_concurrent_generations: int = Field(1, ge=1)
    # How episodes meet their environment. batched: the episodes whose turns came out of one
    # generate call are stepped together, one call per environment (a verifier pool fans them
    # out over its workers). per_episode: each episode on its own call, so it goes on as soon
    # as its own tool returns (tools whose calls take different times); the environment must
    # then serve several calls at once, or the calls queue. auto: per_episode for the
    # environments that serve concurrent steps (their class's ``concurrent_steps``: the tool
    # environment), batched for the others.
    env_steps: Literal["auto", "batched", "per_episode"] = "auto"
    # Most tool calls (``role: tool`` replies) an episode makes; it ends after the step that
    # reaches it, unscored (reward 0, end reason tool_call_limit). A tool environment's own
    # max_tool_calls instead lets the model give its final answer once the budget is spent:
    # set that one, and this one (if at all) above it. null: no limit.
    max_tool_calls: int | None = Field(None, ge=1)
    # Most seconds an episode runs; checked between turns. null: no limit.
    max_episode_seconds: float | None = Field(None, gt=0)
    # Most seconds an environment step may take, counted from when it is sent (time queued
    # behind other steps of an environment that serves one call at a time included, time held
    # at async GRPO's step gate during validation not); its
    # episodes end then (``env_timeout``, left out of the loss) and the late answer is
    # dropped. Set it above the tools' own timeouts. null: wait as long as it takes.
    env_step_timeout_s: float | None = Field(None, gt=0)


class StepGate(Protocol):
    """Holds environment steps back while it is closed (async GRPO's validation) and counts
    those running. ``enter`` blocks while closed, then counts the step until ``leave`` or, with
    ``timeout_s``, until its deadline: a hung step past it no longer holds anyone waiting."""

    def enter(self, timeout_s: float | None) -> object: ...

    def leave(self, token: object) -> None: ...


@dataclass
class _EnvCall:
    """An environment step in flight."""

    task: str
    rows: list[int]
    started: float
    deadline: float | None
    ref: ray.ObjectRef | None = None  # an actor's step: cancelled when cut at its deadline
    gate_token: object | None = None  # its place in the step gate, left when it ends


class _AgentLoop:
    def __init__(
        self,
        episodes: Episodes,
        generation: GenerationInterface,
        config: AgentLoopConfig,
        *,
        max_turns: int,
        greedy: bool,
        expected_weight_version: int | None,
        step_gate: StepGate | None = None,
    ) -> None:
        self.episodes, self.generation, self.config = episodes, generation, config
        self.step_gate = step_gate
        self.max_turns, self.greedy = max_turns, greedy
        self.expected_weight_version = expected_weight_version
        self.generating: dict[Future, tuple[list[int], float]] = {}
        self.stepping: dict[Future, _EnvCall] = {}
        self.waiting: list[int] = list(episodes.active)
        self.base_seeds = self._base_seeds()
        self.generation_seconds: list[float] = []
        self.generation_rows: list[int] = []
        self.env_seconds: list[float] = []
        self.generators = ThreadPoolExecutor(config.max_concurrent_generations, "agent-gen")
        # Which environments step each episode on its own call.
        if config.env_steps == "auto":
            self.per_episode = serves_concurrent_steps(episodes.envs)
        else:
            self.per_episode = dict.fromkeys(episodes.envs, config.env_steps == "per_episode")
        # In-process environments' threads, one pool per environment (Ray actors need none).
        self.env_threads = {
            task: ThreadPoolExecutor(
                MAX_ENV_THREADS if self.per_episode[task] else 1, f"agent-env-{task}"
            )
            for task, env in episodes.envs.items()
            if not hasattr(env.step, "remote")
        }

    def _base_seeds(self) -> torch.Tensor | None:
        seeds = getattr(self.generation, "seeds", None)
        if self.greedy or not isinstance(seeds, SamplingSeeds) or not self.waiting:
            return None
        seeded = torch.zeros(len(self.episodes.logs), dtype=torch.int64)
        version = self.generation.weight_version
        seeded[self.waiting] = seeds.next_call(version, len(self.waiting))
        return seeded

    def run(self) -> None:
        try:
            while self.waiting or self.generating or self.stepping:
                self._start_generations()
                done, _ = wait(
                    [*self.generating, *self.stepping],
                    timeout=self._time_to_next_deadline(),
                    return_when=FIRST_COMPLETED,
                )
                for future in done:
                    if future in self.generating:
                        self._generated(future)
                    else:
                        self._stepped(future)
                self._cut_late_steps()
        finally:
            for call in self.stepping.values():  # (the loop failed: nobody waits for these)
                self._leave_gate(call)
            # A step that hangs keeps its thread; nobody waits for it.
            for pool in (self.generators, *self.env_threads.values()):
                pool.shutdown(wait=False, cancel_futures=True)

    def _start_generations(self) -> None:
        ep = self.episodes
        if self.config.max_episode_seconds is not None:
            for i in self.waiting:
                if time.monotonic() - ep.started_at >= self.config.max_episode_seconds:
                    ep.finish(i, TIME_LIMIT)
            self.waiting = [i for i in self.waiting if ep.goes_on(i)]
        if not self.waiting or len(self.generating) >= self.config.max_concurrent_generations:
            return
        rows, self.waiting = self.waiting, []
        data = ep.generation_input(rows)
        if self.base_seeds is not None:
            data[SEEDS_KEY] = torch.tensor([self._turn_seed(i) for i in rows], dtype=torch.int64)
        future = self.generators.submit(
            self.generation.generate,
            data,
            greedy=self.greedy,
            expected_weight_version=self.expected_weight_version,
        )
        self.generating[future] = (rows, time.monotonic())

    def _turn_seed(self, i: int) -> int:
        base, turn = int(self.base_seeds[i]), int(self.episodes.turns[i])  # type: ignore[index]
        return base if turn == 0 else row_seed(base, turn)

    def _generated(self, future: Future) -> None:
        rows, started = self.generating.pop(future)
        try:
            out: BatchedDataDict = future.result()
        except Exception as e:  # its type stays (a caller may handle stale weights)
            e.add_note(f"(while generating the turns of episodes {rows} of the rollout)")
            raise
        self.generation_seconds.append(time.monotonic() - started)
        self.generation_rows.append(len(rows))
        if out.size != len(rows):
            raise RuntimeError(f"the generator returned {out.size} rows for {len(rows)} prompts")
        for j, i in enumerate(rows):
            self.episodes.add_response(i, out, j)
        for task, task_rows in rows_by_task(self.episodes.envs, self.episodes.tasks, rows).items():
            if self.per_episode[task]:
                for i in task_rows:
                    self._step(task, [i])
            else:
                self._step(task, task_rows)

    def _step(self, task: str, rows: list[int]) -> None:
        ep = self.episodes
        env = ep.envs[task]
        logs, metadata = [ep.logs[i] for i in rows], [ep.metadata[i] for i in rows]
        timeout = self.config.env_step_timeout_s
        # Blocks while the gate is closed: the step's deadline starts once it is let through.
        token = None if self.step_gate is None else self.step_gate.enter(timeout)
        ref = None
        if hasattr(env.step, "remote"):
            ref = step_remote(env, logs, metadata)
            future = ref.future()
        else:
            future = self.env_threads[task].submit(env.step, logs, metadata)
        now = time.monotonic()
        self.stepping[future] = _EnvCall(
            task, rows, now, None if timeout is None else now + timeout, ref, token
        )

    def _leave_gate(self, call: _EnvCall) -> None:
        if self.step_gate is not None and call.gate_token is not None:
            self.step_gate.leave(call.gate_token)
            call.gate_token = None

    def _stepped(self, future: Future) -> None:
        call = self.stepping.pop(future)
        self._leave_gate(call)
        self.env_seconds.append(time.monotonic() - call.started)
        try:
            returned = resolve_env_call(future.result())
        except Exception as e:  # an actor's death names it and its cause; its type stays
            e.add_note(f"(in env.{call.task}'s step of episodes {call.rows} of the rollout)")
            raise
        steps = split_steps(call.task, returned, len(call.rows))
        ep, going, going_steps = self.episodes, [], []
        for i, step in zip(call.rows, steps, strict=True):
            ep.apply_step(i, step)
            self._check_limits(i)
            if ep.goes_on(i):
                going.append(i)
                going_steps.append(step)
        self.waiting.extend(ep.continue_with(going, going_steps))

    def _check_limits(self, i: int) -> None:
        """End episode ``i`` at a limit reached by the turn it just played."""
        ep, config = self.episodes, self.config
        if int(ep.turns[i]) >= self.max_turns:
            ep.finish(i, TURN_LIMIT)
        elif config.max_tool_calls is not None and int(ep.tool_calls[i]) >= config.max_tool_calls:
            ep.finish(i, TOOL_CALL_LIMIT)
        elif (
            config.max_episode_seconds is not None
            and time.monotonic() - ep.started_at >= config.max_episode_seconds
        ):
            ep.finish(i, TIME_LIMIT)

    def _time_to_next_deadline(self) -> float | None:
        deadlines = [c.deadline for c in self.stepping.values() if c.deadline is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _cut_late_steps(self) -> None:
        now = time.monotonic()
        late = [f for f, c in self.stepping.items() if c.deadline is not None and c.deadline <= now]
        for future in late:
            call = self.stepping.pop(future)
            self._leave_gate(call)
            self.env_seconds.append(now - call.started)
            for i in call.rows:
                self.episodes.finish(i, ENV_TIMEOUT)
            future.cancel()  # an in-process call not started yet never starts
            if call.ref is not None:
                # Not forced (that would kill the actor): Ray drops a step not yet started and
                # marks a running one, which can stop early (``ray.get_runtime_context()
                # .is_canceled()``), so the actor is free for the next steps sooner.
                ray.cancel(call.ref)

    def timings(self) -> dict[str, float]:
        gen, env, rows = self.generation_seconds, self.env_seconds, self.generation_rows
        return {
            "agent_loop/generation_calls": float(len(gen)),
            "agent_loop/generation_seconds": sum(gen),
            "agent_loop/env_step_seconds": sum(env),
            "agent_loop/generation_batch_mean": sum(rows) / len(rows) if rows else 0.0,
            "agent_loop/generation_latency_mean_s": sum(gen) / len(gen) if gen else 0.0,
            "agent_loop/generation_latency_max_s": max(gen, default=0.0),
            "agent_loop/env_step_latency_mean_s": sum(env) / len(env) if env else 0.0,
            "agent_loop/env_step_latency_max_s": max(env, default=0.0),
        }


def run_agent_loop(
    generation: GenerationInterface,
    batch: BatchedDataDict,
    tokenizer: Any,
    template: ChatTemplate,
    envs: Mapping[str, Any],
    *,
    max_seq_len: int,
    max_turns: int = 1,
    greedy: bool = False,
    expected_weight_version: int | None = None,
    with_env_metrics: bool = True,
    config: AgentLoopConfig | None = None,
    step_gate: StepGate | None = None,
) -> RolloutResult:
    """Roll ``batch`` out, each episode at its own pace (see the module docstring); what
    ``rollouts.run_rollouts`` runs. ``step_gate``: every environment step passes it (the
    trajectory collector's, which validation closes)."""
    episodes = Episodes(batch, tokenizer, template, envs, max_seq_len)
    rows_by_task(envs, episodes.tasks, episodes.active)  # an unknown task fails before sampling
    loop = _AgentLoop(
        episodes,
        generation,
        config or AgentLoopConfig(),
        max_turns=max_turns,
        greedy=greedy,
        expected_weight_version=expected_weight_version,
        step_gate=step_gate,
    )
    loop.run()
    episodes.timings.update(loop.timings())
    return episodes.result(with_env_metrics)
