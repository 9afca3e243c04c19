"""The environments as a rollout calls them: a step per sample, batched per environment, and
the environments' metrics of a rolled-out batch. An environment is a Ray actor or, in tests and
benchmarks, an in-process object with the same methods."""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from rl_data.array_pickling import ArrayPickled
from rl_data.types import MessageLog
from rl_envs.interfaces import EnvironmentReturn, EnvironmentStep


def call_env(env: Any, logs: list[MessageLog], metadata: list[Any]) -> Any:
    """A Ray actor's ``step.remote`` future, or an in-process environment's result."""
    if hasattr(env.step, "remote"):
        return step_remote(env, logs, metadata)
    return env.step(logs, metadata)


def step_remote(env: Any, logs: list[MessageLog], metadata: list[Any]) -> ray.ObjectRef:
    """An environment actor's ``step`` call. The conversations carry a tensor or more per
    message, which pickle many times faster as arrays (``ArrayPickled``)."""
    return env.step.remote(ArrayPickled(logs), ArrayPickled(metadata))


# What each environment actor said of its ``concurrent_steps``: fixed by its class, so asked once
# per actor (an actor that serves one call at a time would answer only after its queued steps).
_SERVES_CONCURRENT_STEPS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def serves_concurrent_steps(envs: Mapping[str, Any]) -> dict[str, bool]:
    """Whether each environment's ``step`` may be called several times at once (its class's
    ``EnvironmentInterface.concurrent_steps``): read off an in-process environment, asked of an
    actor (all at once, then remembered). An environment that does not say is taken to serve
    one call at a time."""
    asked: dict[str, Any] = {}
    out: dict[str, bool] = {}
    for task, env in envs.items():
        if not hasattr(env.step, "remote"):
            out[task] = bool(getattr(env, "concurrent_steps", False))
        elif env in _SERVES_CONCURRENT_STEPS:
            out[task] = _SERVES_CONCURRENT_STEPS[env]
        elif hasattr(env, "serves_concurrent_steps"):  # an actor of an EnvironmentInterface
            asked[task] = env.serves_concurrent_steps.remote()
        else:
            out[task] = False
    if asked:  # (ray.get starts Ray, even for nothing)
        for task, answer in zip(asked, ray.get(list(asked.values())), strict=True):
            out[task] = _SERVES_CONCURRENT_STEPS[envs[task]] = bool(answer)
    return {task: out[task] for task in envs}


def resolve_env_call(result: Any) -> EnvironmentReturn:
    return ray.get(result) if isinstance(result, ray.ObjectRef) else result


def rows_by_task(
    envs: Mapping[str, Any], task_names: Sequence[str], rows: Sequence[int] | None = None
) -> dict[str, list[int]]:
    """The samples (``rows``, default all) of each task, in order; a ``KeyError`` naming a
    sample whose task has no environment."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for i in range(len(task_names)) if rows is None else rows:
        task = task_names[i]
        if task not in envs:
            raise KeyError(
                f"sample {i} has task_name {task!r} but no environment is configured for it "
                f"(env: {sorted(envs)})"
            )
        by_task[task].append(i)
    return by_task


def split_steps(task: str, ret: EnvironmentReturn, samples: int) -> list[EnvironmentStep]:
    """Each sample's step of environment ``task``'s answer to a call with ``samples`` samples."""
    if len(ret.rewards) != samples:
        raise RuntimeError(
            f"environment {task!r} returned {len(ret.rewards)} rewards for {samples} samples"
        )
    return ret.steps()


def step_environments(
    envs: Mapping[str, Any],
    logs: Sequence[MessageLog],
    metadata: Sequence[Any],
    task_names: Sequence[str],
) -> list[EnvironmentStep]:
    """One environment step per sample, in the order of ``logs``, batched per environment and
    run concurrently."""
    by_task = rows_by_task(envs, task_names)
    pending = {
        task: call_env(envs[task], [logs[i] for i in rows], [metadata[i] for i in rows])
        for task, rows in by_task.items()
    }
    steps: dict[int, EnvironmentStep] = {}
    for task, rows in by_task.items():
        ret = resolve_env_call(pending[task])
        steps.update(zip(rows, split_steps(task, ret, len(rows)), strict=True))
    return [steps[i] for i in range(len(logs))]


def environment_metrics(
    envs: Mapping[str, Any],
    task_names: Sequence[str],
    rewards: torch.Tensor,
    group_ids: Sequence[Any] | None,
) -> dict[str, float]:
    """Each environment's own metrics over its samples of a rolled-out batch (accuracy,
    pass@k, timeouts, verifier errors...), as ``env/<task>/<name>``; run concurrently.

    ``group_ids`` (the dataset row of each sample: the G samples of a prompt share it) lets
    an environment report pass@k.
    """
    by_task: dict[str, list[int]] = defaultdict(list)
    for i, task in enumerate(task_names):
        if task in envs:  # a sample too long to generate from never met its environment
            by_task[task].append(i)
    batches: dict[str, dict[str, Any]] = {}
    for task, rows in by_task.items():
        batches[task] = {"rewards": rewards[rows]}
        if group_ids is not None:
            batches[task]["group_ids"] = [group_ids[i] for i in rows]
    return _post_process(envs, batches)


def take_environment_counts(envs: Mapping[str, Any]) -> dict[str, float]:
    """What every environment counted since its last metrics call (``env/<task>/<name>``:
    samples, timeouts, per-function values...), which starts its counts again from zero; a
    call with no samples, so no reward metrics."""
    empty = {task: {"rewards": torch.zeros(0)} for task in envs}
    return _post_process(envs, empty)


def _post_process(envs: Mapping[str, Any], batches: Mapping[str, dict]) -> dict[str, float]:
    """Each environment's ``global_post_process_and_metrics`` of its batch, concurrently."""
    pending = {}
    for task, batch in batches.items():
        post = envs[task].global_post_process_and_metrics
        pending[task] = post.remote(batch) if hasattr(post, "remote") else post(batch)
    out = {}
    for task, call in pending.items():
        _, metrics = ray.get(call) if isinstance(call, ray.ObjectRef) else call
        out.update({f"env/{task}/{name}": float(value) for name, value in metrics.items()})
    return out
