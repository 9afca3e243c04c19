"""An environment whose reward is a weighted sum of reward functions (``env.<task>.kind:
reward_functions``)::

    env:
      arithmetic:
        kind: reward_functions
        config:
          functions:
            - {function: math, weight: 1.0}                        # the built-in math reward
            - {name: short, function: my_rewards.py:brevity, weight: 0.1}

Each function is called once per completion, in the verifier pool's processes, under the
per-sample ``timeout_s``: the isolation rules of the built-in environments (a function that
hangs costs that sample's value, never the run). A value that is ``None`` (or a timeout, or an
exception) is left out of the weighted sum. What a function returns is checked: anything but one
number or ``None`` per completion stops the run, naming the function and the sample, since such
a function would otherwise train on garbage. So does a function that raises on every sample of a
batch (a wrong signature, a missing column): a reward of 0 everywhere would say nothing.

Each function's metrics are logged under its name: ``<name>/mean``, ``<name>/std`` (over its
non-``None`` values), ``<name>/none_fraction`` and its timeouts and errors.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from rl_data.types import MessageLog
from rl_distributed.config import ConfigModel
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn, check_required_metadata
from rl_envs.metrics import OutcomeCounts, reward_metrics
from rl_envs.pool import WorkerPool
from rl_envs.reward_functions import (
    BUILTIN_PRELOAD,
    ValueStats,
    check_value,
    combine,
    load_reward_function,
    required_columns,
    resolve_reference,
)
from rl_envs.verifier_env import VerifierEnvConfig

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
FAILED_BATCHES_TO_STOP = 3


class RewardFunctionSpec(ConfigModel):
    # A built-in name ("math"), "package.module:function" or "path/to/file.py:function" (a
    # relative path is taken from the directory the run starts in).
    function: str
    # Its weight in the sum of the functions' rewards.
    weight: float = Field(1.0, allow_inf_nan=False)
    name: str | None = None  # in the metrics' names; None: the built-in's or function's name

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        # From the name as written ("math", not the path it stands for).
        if isinstance(data, dict) and data.get("name") is None and "function" in data:
            data = {**data, "name": str(data["function"]).rpartition(":")[2]}
        return data

    @field_validator("function")
    @classmethod
    def _loads(cls, ref: str) -> str:
        # Imported here, at config validation, so that a typo fails before any worker starts.
        load_reward_function(ref)
        return resolve_reference(ref)

    @model_validator(mode="after")
    def _named(self) -> RewardFunctionSpec:
        if not _NAME.fullmatch(self.name or ""):
            raise ValueError(f"name {self.name!r}: use letters, digits, '_', '.' or '-'")
        return self


class RewardFunctionsEnvConfig(VerifierEnvConfig):
    # The reward functions (function, weight, name) whose weighted sum is the reward.
    functions: list[RewardFunctionSpec] = Field(min_length=1)
    # Where this config sits in the recipe, for error messages (set by the recipe's loader).
    config_key: str = "reward_functions"

    @field_validator("functions")
    @classmethod
    def _unique_names(cls, functions: list[RewardFunctionSpec]) -> list[RewardFunctionSpec]:
        names = [f.name for f in functions]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"two functions are named {repeated[0]!r}: give one a 'name'")
        return functions


def _prompt_and_completion(log: MessageLog) -> tuple[list[dict[str, str]], str]:
    """The conversation before the last assistant turn (roles and contents only) and that turn."""
    last = max((i for i, m in enumerate(log) if m["role"] == "assistant"), default=len(log))
    prompt = [{"role": m["role"], "content": m["content"]} for m in log[:last]]
    return prompt, (log[last]["content"] if last < len(log) else "")


class RewardFunctionsEnvironment(EnvironmentInterface):
    """Single-turn: one weighted reward per completion. Metadata per sample: the row's columns,
    passed to every function as keyword arguments."""

    def __init__(self, cfg: RewardFunctionsEnvConfig) -> None:
        self.cfg = cfg
        self.functions = cfg.functions
        self.weights = [f.weight for f in cfg.functions]
        # A row without a column a function reads is refused (check_required_metadata), not
        # scored 0.
        self.required_metadata = self.required_metadata_for(cfg)  # type: ignore[misc]
        self.counts = {f.name: OutcomeCounts() for f in cfg.functions}
        self.values = {f.name: ValueStats() for f in cfg.functions}
        # Batches in a row in which a function gave no value for any sample (every call raised
        # or timed out): a few such batches in a row stop the run. Counted across batches,
        # because async GRPO scores one group (one prompt's samples) at a time.
        self.failed_batches = {f.name: 0 for f in cfg.functions}
        preload = [m for f in cfg.functions for m in BUILTIN_PRELOAD.get(f.function, ())]
        # Each function is imported when its verifier process starts, under the start-up
        # timeout: a file whose top-level code is slow must not time out every sample instead.
        preload += [f.function for f in cfg.functions if f.function not in BUILTIN_PRELOAD]
        self._pool = WorkerPool(
            "rl_envs.reward_functions:call_reward_function",
            num_workers=cfg.num_workers,
            timeout_s=cfg.timeout_s,
            chunk_size=cfg.chunk_size,
            num_cpus_per_worker=cfg.num_cpus_per_worker,
            preload=tuple(dict.fromkeys(preload)),
        )

    @classmethod
    def required_metadata_for(cls, cfg: RewardFunctionsEnvConfig) -> tuple[str, ...]:
        """The columns the functions name as arguments without a default."""
        columns = [
            column
            for spec in cfg.functions
            for column in required_columns(load_reward_function(spec.function))
        ]
        return tuple(dict.fromkeys(columns))

    def _where(self, f: int) -> str:
        spec = self.functions[f]
        return f"{self.cfg.config_key}.functions[{f}] ({spec.name}: {spec.function})"

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        check_required_metadata(self, metadata)  # a missing column is no 0 reward
        n = len(message_log_batch)
        samples = [_prompt_and_completion(log) for log in message_log_batch]
        # One job per (function, completion): each under its own timeout, spread over the pool.
        jobs = [
            (spec.function, prompt, completion, dict(meta or {}))
            for spec in self.functions
            for (prompt, completion), meta in zip(samples, metadata, strict=True)
        ]
        outcomes = self._pool.map(jobs)
        values: list[list[float | None]] = []
        for f, spec in enumerate(self.functions):
            mine = outcomes[f * n : (f + 1) * n]
            errors = [(i, o.error) for i, o in enumerate(mine) if o.status == "error"]
            failed = sum(o.status != "ok" for o in mine)
            self.failed_batches[spec.name] = (
                self.failed_batches[spec.name] + 1 if n and failed == n else 0
            )
            if self.failed_batches[spec.name] >= FAILED_BATCHES_TO_STOP:
                cause = errors[0][1] if errors else f"every call timed out ({self.cfg.timeout_s}s)"
                raise RuntimeError(
                    f"{self._where(f)} gave no value for any sample of {FAILED_BATCHES_TO_STOP} "
                    f"batches in a row (it raised or timed out); last batch, sample 0 (prompt "
                    f"{samples[0][0][-1:]!r:.200}): {cause}"
                )
            if errors:
                logger.warning("%s raised on sample %d: %s", self._where(f), *errors[0])
            column: list[float | None] = []
            for i, outcome in enumerate(mine):
                self.counts[spec.name].add(outcome.status)
                value = None
                if outcome.status == "ok":
                    try:
                        value = check_value(outcome.value)
                    except TypeError as e:
                        raise ValueError(
                            f"{self._where(f)} {e}; at sample {i} of the batch (completion "
                            f"{samples[i][1]!r:.200}, columns {sorted(metadata[i] or {})})"
                        ) from None
                column.append(value)
            values.append(column)
            self.values[spec.name].add(column)
        rewards = combine(values, self.weights)
        answers = [
            " ".join(f"{s.name}={_show(v[i])}" for s, v in zip(self.functions, values, strict=True))
            for i in range(n)
        ]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"reward {r:g}"} for r in rewards],
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        metrics = reward_metrics(
            batch["rewards"],
            batch.get("group_ids"),
            ks=self.cfg.pass_at_k,
            success_threshold=self.cfg.success_threshold,
        )
        # Each function's values and outcomes since the last metrics call, as steps saw them.
        for name, values in self.values.items():
            metrics.update({f"{name}/{k}": v for k, v in values.take().items()})
            metrics.update({f"{name}/{k}": v for k, v in self.counts[name].take().items()})
        return batch, metrics

    def shutdown(self) -> None:
        self._pool.shutdown()


def _show(value: float | None) -> str:
    return "None" if value is None else f"{value:g}"
