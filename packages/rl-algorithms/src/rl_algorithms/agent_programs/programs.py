"""Rollouts played by agent programs the library did not write (``run_program_rollouts``).

A program is a Python function ``module:function(base_url: str, row: dict) -> result`` (a
``def`` or an ``async def``; ``path/to/file.py:function`` works too), or a command that gets
``OPENAI_BASE_URL`` (and ``OPENAI_API_KEY``) in its environment and the row as JSON on stdin,
its stdout being its result. Each sample of the batch is one episode: the program is started
with the episode's own base URL (``server.EndpointServer``) and the sample's row (its prompt
messages as ``messages``, the dataset's columns beside them), and talks to the policy through
the endpoint, which records every request into the episode's ``Trajectory``.

An episode ends when its program returns, raises, or reaches ``max_episode_seconds`` (a
command is killed then; a Python function cannot be, so its thread is left behind and any
request it still makes is refused). Then the episode's final conversation, the trajectory's
message log, is scored by the environment of the row's task, as any rollout's last turn is
(``result_column``: the program's return value goes to the reward functions as that column).
Failed episodes are counted by reason (``agent_program/failed/<reason>``), scored 0 and kept
out of the loss (``RolloutResult.sample_mask``); what a program printed on the way is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
import json
import logging
import os
import pickle
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from rl_algorithms.agent_loop import StepGate
from rl_algorithms.agent_programs.config import AgentProgramConfig
from rl_algorithms.agent_programs.server import EndpointServer, Episode, GenerationBatcher
from rl_algorithms.agent_programs.trajectories import (
    FAILED_ERROR,
    FAILED_TIMEOUT,
    FAILURES,
    Trajectory,
)
from rl_algorithms.environment_calls import rows_by_task, step_environments
from rl_algorithms.episodes import Episodes
from rl_algorithms.rollout_result import RolloutResult
from rl_algorithms.utils.threads import start_thread
from rl_data.templates import ChatTemplate
from rl_data.types import STRING_PROMPT_KEY, TOOLS_KEY
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.reward_functions import load_reward_function
from rl_models.generation.interfaces import GenerationInterface

logger = logging.getLogger(__name__)


def program_row(message_log: list[dict[str, Any]], env_info: Mapping[str, Any] | None) -> dict:
    """What a program gets of a sample: the dataset's columns, its prompt as ``messages``
    (roles and text) and, if the dataset's prompt was a string, that as ``prompt``."""
    info = dict(env_info or {})
    row = {k: v for k, v in info.items() if k != STRING_PROMPT_KEY}
    row["messages"] = [{"role": m["role"], "content": m["content"]} for m in message_log]
    if isinstance(info.get(STRING_PROMPT_KEY), str):
        row["prompt"] = info[STRING_PROMPT_KEY]
    if isinstance(row.get(TOOLS_KEY), str):
        row[TOOLS_KEY] = json.loads(row[TOOLS_KEY])
    return row


# How a rollout stops a program it cuts while it runs: cancels its coroutine, or kills its
# command. (A plain function cannot be stopped: its thread is left behind.)
Stopper = Callable[[], None]


class _Stoppers:
    """How to stop each episode's program, handed over by its thread as it starts. An episode
    cut before its program handed it over is stopped as it does (a slow start must not let a
    program escape its deadline)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stoppers: dict[int, Stopper] = {}
        self._cut: set[int] = set()

    def register(self, episode: int, stopper: Stopper) -> None:
        with self._lock:
            self._stoppers[episode] = stopper
            cut = episode in self._cut
        if cut:
            stopper()

    def stop(self, episode: int) -> None:
        with self._lock:
            self._cut.add(episode)
            stopper = self._stoppers.get(episode)
        if stopper is not None:
            stopper()


def _run_function(
    function: Any, base_url: str, row: dict, started: Callable[[Stopper], None]
) -> Any:
    """The function's result; an ``async def`` runs in an event loop of its own (closed as
    ``asyncio.run`` closes one: its other tasks and async generators are finished), and its
    cancelling is handed to ``started``."""
    if not inspect.iscoroutinefunction(function):
        return function(base_url, row)

    async def main() -> Any:
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None

        def cancel() -> None:
            with contextlib.suppress(RuntimeError):  # (the loop is closed: it has ended)
                loop.call_soon_threadsafe(task.cancel)

        started(cancel)
        return await function(base_url, row)

    return asyncio.run(main())


def _run_command(command: str, base_url: str, row: dict, started: Callable[[Stopper], None]) -> Any:
    """The command's result; killing it (and what it started) is handed to ``started``."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "rl-agent-endpoint"}
    process = subprocess.Popen(
        shlex.split(command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: what it starts is killed with it
    )
    started(functools.partial(_kill_command, process))
    try:
        stdout, stderr = process.communicate(json.dumps(row))
    finally:
        # What it left running, while its process group's id cannot be anyone else's yet.
        _kill_command(process)
    if process.returncode != 0:
        raise RuntimeError(
            f"agent_program.command exited with {process.returncode}: {stderr[-2000:]}"
        )
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        return stdout


def _kill_command(process: subprocess.Popen) -> None:
    """Kill a command and every process it started that is still in its process group (a
    shell's or ``uv run``'s children would otherwise go on calling the endpoint)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def run_program_rollouts(
    server: EndpointServer,
    config: AgentProgramConfig,
    generation: GenerationInterface,
    batch: BatchedDataDict,
    tokenizer: Any,
    template: ChatTemplate,
    envs: Mapping[str, Any],
    *,
    max_seq_len: int,
    temperature: float,
    top_p: float,
    greedy: bool = False,
    expected_weight_version: int | None = None,
    with_env_metrics: bool = True,
    stop: Future | None = None,
    step_gate: StepGate | None = None,
    paused_seconds: Callable[[], float] | None = None,
) -> RolloutResult:
    """One episode per row of ``batch`` (``message_log``, ``extra_env_info``, ``task_name``),
    each played by the program through ``server``; the rollout's result, as ``run_rollouts``
    gives it (see the module docstring).

    The rollout stops at once when the generator fails or ``stop`` (async GRPO's collector
    giving up on the group) completes: every episode ends (a request waiting for its reply, and
    any later one, is refused, so the program sees an error), a command is killed, and the
    generator's failure, or ``stop``'s exception, is raised. ``step_gate``: the scoring step
    passes it (the collector's, which validation closes). ``paused_seconds``: the seconds the
    caller has been paused so far (the collector's drains for refits and validation, during
    which no request is answered); time paused does not count against an episode's
    ``max_episode_seconds``, so an episode in flight through a validation is not cut for it."""
    n = batch.size
    tasks = list(batch["task_name"])
    rows_by_task(envs, tasks)  # an unknown task fails before any program starts
    function = None if config.function is None else load_reward_function(config.function)
    batcher = GenerationBatcher(generation, tokenizer.pad_token_id, greedy, expected_weight_version)
    trajectories = [
        Trajectory(
            server.new_episode_id(),
            tokenizer,
            template,
            max_seq_len,
            config.max_requests_per_episode,
        )
        for _ in range(n)
    ]
    for t in trajectories:
        server.register(
            Episode(
                t, batcher, temperature, top_p, config.tool_call_parser, config.max_request_bytes
            )
        )
    late_before = server.late_requests
    started = time.monotonic()
    results: list[Any] = [None] * n
    stoppers = _Stoppers()
    halts = [batcher.failed] if stop is None else [batcher.failed, stop]
    paused = paused_seconds or (lambda: 0.0)

    def deadlines(running: dict[Future, tuple[int, float, float]]) -> dict[Future, float]:
        """Each running program's deadline, pushed back by the pauses since it started."""
        now_paused = paused()
        return {f: deadline + now_paused - then for f, (_, deadline, then) in running.items()}

    # Each running program's episode, its deadline as it stood when it started and the
    # seconds paused by then (``deadlines`` adds the pauses since).
    running: dict[Future, tuple[int, float, float]] = {}
    try:
        waiting = list(range(n))
        while (waiting or running) and not any(h.done() for h in halts):
            while waiting and len(running) < config.max_concurrent_episodes:
                i = waiting.pop(0)
                url = server.base_url(trajectories[i].episode_id)
                row = program_row(batch["message_log"][i], batch["extra_env_info"][i])
                on_start = functools.partial(stoppers.register, i)
                future = (
                    start_thread("agent-program", _run_function, function, url, row, on_start)
                    if function is not None
                    else start_thread(
                        "agent-program", _run_command, config.command, url, row, on_start
                    )
                )
                deadline = time.monotonic() + config.max_episode_seconds
                running[future] = (i, deadline, paused())
            done, _ = wait(
                [*running, *halts],
                timeout=max(0.0, min(deadlines(running).values()) - time.monotonic()),
                return_when=FIRST_COMPLETED,
            )
            now = time.monotonic()  # (deadlines again: a pause may have begun meanwhile)
            for future in [*done, *(f for f, d in deadlines(running).items() if d <= now)]:
                if future not in running:
                    continue
                i, _, _ = running.pop(future)
                results[i] = _outcome(future, trajectories[i], config)
                trajectories[i].end()
                if not future.done():  # cut at its deadline
                    stoppers.stop(i)
    finally:
        for t in trajectories:
            t.end()
        for future, (i, _, _) in running.items():  # the rollout stopped early
            if not future.done():
                stoppers.stop(i)
        batcher.close()
        server.unregister([t.episode_id for t in trajectories])
    for halt in halts:  # the generator's failure is the run's, not the agents'
        if halt.done():
            raise halt.exception() or RuntimeError("the agent-program rollout was stopped")
    return _scored(
        trajectories,
        results,
        batch,
        tokenizer,
        template,
        envs,
        config,
        max_seq_len,
        with_env_metrics,
        step_gate,
        {
            "agent_program/late_requests": float(
                sum(t.late_requests for t in trajectories) + server.late_requests - late_before
            ),
            "agent_program/generation_calls": float(len(batcher.call_sizes)),
            "agent_program/generation_batch_mean": (
                sum(batcher.call_sizes) / len(batcher.call_sizes) if batcher.call_sizes else 0.0
            ),
        },
        {
            "agent_program/seconds": time.monotonic() - started,
            "agent_program/generation_seconds": batcher.seconds,
        },
    )


def rollout_through_programs(
    run: Any,
    config: AgentProgramConfig,
    prompts: BatchedDataDict,
    *,
    max_seq_len: int,
    greedy: bool = False,
    expected_weight_version: int | None = None,
    with_env_metrics: bool = True,
) -> RolloutResult:
    """``run_program_rollouts`` on a ``Run``'s generator, tokenizer, template, environments
    and sampling settings, through its endpoint (``run.agent_endpoint``, started on the first
    call): sync GRPO's rollouts and ``rl eval`` play agent programs here."""
    if run.agent_endpoint is None:
        run.agent_endpoint = EndpointServer()
    sampling = run.config.generation.sampling
    return run_program_rollouts(
        run.agent_endpoint,
        config,
        run.generation,
        prompts,
        run.tokenizer,
        run.template,
        run.envs,
        max_seq_len=max_seq_len,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        greedy=greedy,
        expected_weight_version=expected_weight_version,
        with_env_metrics=with_env_metrics,
    )


def _outcome(future: Future, trajectory: Trajectory, config: AgentProgramConfig) -> Any:
    """The program's return value; a failure (raised, or still running at its deadline)
    marks the episode."""
    if not future.done():
        trajectory.fail(FAILED_TIMEOUT)
        logger.warning(
            "agent program of episode %s cut at agent_program.max_episode_seconds (%g s)",
            trajectory.episode_id,
            config.max_episode_seconds,
        )
        return None
    error = future.exception()
    if error is None and config.result_column is not None:
        # The result travels with the episode's metadata to the environments' actors and, in
        # async GRPO, into checkpoints (of the episodes not yet trained on): one that plain
        # pickle cannot write (Ray's cloudpickle takes more, such as a class defined in a
        # function) fails its episode here, not the run there.
        try:
            pickle.dumps(future.result())
        except Exception as e:
            error = TypeError(f"its result cannot be sent on as {config.result_column}: {e!r}")
    if error is None:
        return future.result()
    trajectory.fail(FAILED_TIMEOUT if isinstance(error, TimeoutError) else FAILED_ERROR)
    logger.warning("agent program of episode %s failed: %r", trajectory.episode_id, error)
    return None


def _scored(
    trajectories: list[Trajectory],
    results: list[Any],
    batch: BatchedDataDict,
    tokenizer: Any,
    template: ChatTemplate,
    envs: Mapping[str, Any],
    config: AgentProgramConfig,
    max_seq_len: int,
    with_env_metrics: bool,
    step_gate: StepGate | None,
    metrics: dict[str, float],
    timings: dict[str, float],
) -> RolloutResult:
    """The episodes' final conversations scored by their tasks' environments, as one
    ``RolloutResult`` (a failed episode keeps what it recorded, or its prompt if nothing)."""
    n = len(trajectories)
    logs = [t.log if t.requests else batch["message_log"][i] for i, t in enumerate(trajectories)]
    metadata = [copy.deepcopy(m) for m in batch["extra_env_info"]]
    if config.result_column is not None:
        for meta, result in zip(metadata, results, strict=True):
            meta[config.result_column] = result
    final = BatchedDataDict(
        message_log=logs, extra_env_info=metadata, task_name=list(batch["task_name"])
    )
    if "idx" in batch:
        final["idx"] = batch["idx"]
    episodes = Episodes(final, tokenizer, template, envs, max_seq_len)
    reasons = [t.end_reason for t in trajectories]
    scored = [i for i in range(n) if reasons[i] not in FAILURES]
    # Held while the gate is closed (validation in async GRPO): the environments' counts
    # are then validation's alone.
    token = None if step_gate is None else step_gate.enter(None)
    try:
        steps = step_environments(
            envs,
            [episodes.logs[i] for i in scored],
            [episodes.metadata[i] for i in scored],
            [episodes.tasks[i] for i in scored],
        )
    finally:
        if step_gate is not None:
            step_gate.leave(token)
    for i, step in zip(scored, steps, strict=True):
        episodes.turns[i] = len(trajectories[i].requests)  # the turn this step scores
        episodes.apply_step(i, step)
    for i, t in enumerate(trajectories):
        episodes.turns[i] = len(t.requests)
        episodes.truncated[i] = t.truncated
        episodes.end_reasons[i] = reasons[i]
    episodes.template_mismatches = sum(t.template_mismatches for t in trajectories)
    episodes.timings.update(timings)
    result = episodes.result(with_env_metrics)
    result.metrics.update(metrics)
    result.metrics.update(program_metrics(reasons, [len(t.requests) for t in trajectories]))
    return result


def program_metrics(end_reasons: Sequence[str], requests: Sequence[int]) -> dict[str, float]:
    """What agent-program episodes did, from each one's end reason and request count: those
    that failed, in all and by reason (``agent_program/failed/<reason>``), and the requests an
    episode made. For one rollout or for several put together (a step's groups, an eval)."""
    failed = [r for r in end_reasons if r in FAILURES]
    metrics = {"agent_program/failed_episodes": float(len(failed))}
    for reason in FAILURES:
        metrics[f"agent_program/failed/{reason.rsplit('/', 1)[1]}"] = float(failed.count(reason))
    metrics["agent_program/requests_mean"] = sum(requests) / max(len(requests), 1)
    return metrics
