"""The ``env`` section of a recipe: one environment actor per task name.

    env:
      arithmetic: {kind: math, config: {num_workers: 1}}
      sliding_puzzle: {config: {max_turns: 4}}          # kind defaults to the task name
      qa:                                                # reward functions, weighted
        kind: reward_functions
        config:
          functions:
            - {function: math, weight: 1.0}
            - {function: my_rewards.py:brevity, weight: 0.1}
      calc:                                              # multi-turn tool calling
        kind: tools
        config: {tools: [calculator], functions: [{function: my_rewards.py:correct}]}
      served:                                            # a reward server's scores
        kind: http
        config: {url: "http://reward-host:8000/score"}
      judged:                                            # an LLM judge (rl_algorithms.judge)
        kind: judge
        config: {model: {path: /models/judge}, rubric: "...{prompt}...{response}..."}

``kind`` is a known environment name or an import path ``module:Class`` (a subclass of
``rl_envs.interfaces.EnvironmentInterface`` whose constructor takes its config). Samples are
routed by their ``task_name``. See docs/guides/reward-functions.md for reward functions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from rl_algorithms.config import import_path
from rl_distributed.config import ConfigError, ConfigModel, validate_config

# kind -> (environment class, its config class)
KNOWN_ENVIRONMENTS = {
    "math": ("rl_envs.math_env:MathEnvironment", "rl_envs.math_env:MathEnvConfig"),
    "sliding_puzzle": (
        "rl_envs.sliding_puzzle:SlidingPuzzleEnvironment",
        "rl_envs.sliding_puzzle:SlidingPuzzleConfig",
    ),
    "reasoning_gym": (
        "rl_envs.reasoning_gym_env:ReasoningGymEnvironment",
        "rl_envs.reasoning_gym_env:ReasoningGymEnvConfig",
    ),
    "code": ("rl_envs.code.env:CodeEnvironment", "rl_envs.code.env:CodeEnvConfig"),
    "reward_model": (
        "rl_envs.reward_model_env:RewardModelEnvironment",
        "rl_envs.reward_model_env:RewardModelEnvConfig",
    ),
    "reward_functions": (
        "rl_envs.reward_function_env:RewardFunctionsEnvironment",
        "rl_envs.reward_function_env:RewardFunctionsEnvConfig",
    ),
    "tools": ("rl_envs.tools.env:ToolEnvironment", "rl_envs.tools.env:ToolEnvConfig"),
    "http": (
        "rl_envs.http_reward_env:HttpRewardEnvironment",
        "rl_envs.http_reward_env:HttpRewardEnvConfig",
    ),
    # In rl-algorithms, not rl-envs: its judge samples on a generation backend (rl-models).
    "judge": ("rl_algorithms.judge:JudgeEnvironment", "rl_algorithms.judge:JudgeEnvConfig"),
}


class EnvSpec(ConfigModel):
    kind: str | None = None  # None: the task name
    # The environment's own config, checked against its kind's config (see env.<task>.config below).
    config: dict[str, Any] = Field(default_factory=dict)


def environment_class(task: str, spec: EnvSpec) -> tuple[type, Any]:
    """The environment class of ``env.<task>`` and its validated config."""
    kind = spec.kind or task
    if kind in KNOWN_ENVIRONMENTS:
        cls_path, cfg_path = KNOWN_ENVIRONMENTS[kind]
        key = f"env.{task}.kind"
        cls, cfg_cls = import_path(cls_path, key), import_path(cfg_path, key)
        config = dict(spec.config)
        if "config_key" in cfg_cls.model_fields:  # its errors name where it sits in the recipe
            config["config_key"] = f"env.{task}.config"
        try:
            return cls, validate_config(config, cfg_cls)
        except ConfigError as e:  # its keys, as they sit in the recipe
            issues = [replace(i, key=f"env.{task}.config.{i.key}") for i in e.errors]
            raise ConfigError("; ".join(map(str, issues)), issues) from None
    if ":" not in kind:
        raise ValueError(
            f"env.{task}.kind is {kind!r}; expected one of {sorted(KNOWN_ENVIRONMENTS)} or an "
            "import path 'module:Class'"
        )
    return import_path(kind, f"env.{task}.kind"), spec.config


def required_metadata(task: str, spec: EnvSpec) -> tuple[str, ...]:
    """The columns of a row's ``extra_env_info`` that ``env.<task>`` cannot score without (for
    reward functions, the columns their signatures name: known only once the config is read)."""
    cls, cfg = environment_class(task, spec)
    if hasattr(cls, "required_metadata_for"):
        return tuple(cls.required_metadata_for(cfg))
    return tuple(getattr(cls, "required_metadata", ()))


def offered_tools(env: Mapping[str, EnvSpec]) -> dict[str, list[dict[str, Any]]]:
    """Per task, the tools its environment offers a row without a ``tools`` column (see
    ``EnvironmentInterface.offered_tools_for``); tasks without tools are left out."""
    out = {}
    for task, spec in env.items():
        cls, cfg = environment_class(task, spec)
        tools = cls.offered_tools_for(cfg) if hasattr(cls, "offered_tools_for") else None
        if tools is not None:
            out[task] = tools
    return out


def check_environments(env: dict[str, EnvSpec]) -> dict[str, EnvSpec]:
    """Every ``env.<task>`` names an importable environment whose config validates, so that a
    typo fails with the config, before any Ray worker starts (environments start last)."""
    for task, spec in env.items():
        environment_class(task, spec)  # a ConfigError: validate_config reports its keys
    return env


# The ``env`` field of a recipe, checked when the config is validated.
EnvSection = Annotated[dict[str, EnvSpec], AfterValidator(check_environments)]


#: How long an environment actor may take to start: placing its workers (seconds; a pool that
#: cannot be placed is refused then) and their verifier processes' imports.
ENVIRONMENT_STARTUP_TIMEOUT_S = 300.0


def shares_main_cluster(task: str, spec: EnvSpec) -> bool:
    """Whether ``env.<task>`` puts worker groups on the run's own cluster (a colocated judge):
    its class says so with ``shares_main_cluster(cfg)``, and is then built as
    ``cls(cfg, main_cluster)``."""
    cls, cfg = environment_class(task, spec)
    return bool(hasattr(cls, "shares_main_cluster") and cls.shares_main_cluster(cfg))


def start_environments(env: dict[str, EnvSpec], main_cluster: Any = None) -> dict[str, Any]:
    """One Ray actor per task name, each started (its worker pools placed and ready) before
    this returns: an environment that cannot start is an error here, never a wait at step 0.
    ``main_cluster`` (the run's own, counting them among the groups sharing its bundles) goes
    to the environments that share it."""
    import ray

    actors = {}
    free_cpus = ray.available_resources().get("CPU", 0.0)  # the worker groups have theirs
    try:
        for task, spec in env.items():
            cls, cfg = environment_class(task, spec)
            cfg, free_cpus = fit_worker_pool(task, cfg, free_cpus)
            shared = (main_cluster,) if shares_main_cluster(task, spec) else ()
            actors[task] = cls.as_actor(cfg, *shared)
        for task, actor in actors.items():
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=ENVIRONMENT_STARTUP_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"env.{task} did not start within {ENVIRONMENT_STARTUP_TIMEOUT_S:g}s; the "
                    f"Ray cluster has {ray.available_resources()} free"
                ) from None
            except ray.exceptions.RayActorError as e:
                # The constructor's own error (a pool refused, say), without Ray's traceback.
                cause = getattr(e.args[0] if e.args else None, "cause", None) or e
                raise RuntimeError(f"env.{task} could not start: {cause}") from None
    except BaseException:
        stop_environments(actors)
        raise
    return actors


def fit_worker_pool(task: str, cfg: Any, free_cpus: float) -> tuple[Any, float]:
    """``env.<task>``'s config with its verifier pool's size fitted to ``free_cpus`` (see
    ``rl_envs.pool.fit_num_workers``), and the CPUs left for the next environment. The sizes
    are decided here, one environment after the other, because the environments start
    together: each reading the free CPUs itself would count the same CPUs twice. A config
    without a verifier pool is returned as it is.

    On a cluster this run attached to (``RAY_ADDRESS``) a number given is left alone: what is
    free there now depends on other jobs, and an autoscaler may add nodes for it."""
    from pydantic import BaseModel

    from rl_envs.pool import fit_num_workers

    if not (
        isinstance(cfg, BaseModel)
        and hasattr(cfg, "num_workers")
        and hasattr(cfg, "num_cpus_per_worker")
    ):
        return cfg, free_cpus
    if cfg.num_workers is not None and os.environ.get("RAY_ADDRESS"):
        return cfg, free_cpus - cfg.num_workers * cfg.num_cpus_per_worker
    key = f"env.{task}.config.num_workers"
    n = fit_num_workers(cfg.num_workers, cfg.num_cpus_per_worker, free_cpus, key)
    return cfg.model_copy(update={"num_workers": n}), free_cpus - n * cfg.num_cpus_per_worker


def stop_environments(actors: dict[str, Any]) -> None:
    import ray

    for actor in actors.values():
        # Best effort (an environment may own worker pools); the kill below is what counts.
        with contextlib.suppress(Exception):
            ray.get(actor.shutdown.remote(), timeout=30)
        ray.kill(actor)
