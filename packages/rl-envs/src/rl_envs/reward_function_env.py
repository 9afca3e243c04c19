"""An environment whose reward is a weighted sum of reward functions (``env.<task>.kind:
reward_functions``)::

    env:
      arithmetic:
        kind: reward_functions
        config:
          functions:
            - {function: math, weight: 1.0}                        # the built-in math reward
            - {name: short, function: my_rewards.py:brevity, weight: 0.1}

Each function is called once per completion (or, with ``batched: true``, once per step with
every completion; an ``async def`` one is awaited), as TRL calls it (strings for a dataset whose
prompts are strings, message lists for conversations: see :mod:`rl_envs.reward_functions`), in
the verifier pool's processes, under the per-sample ``timeout_s``: the isolation rules of the
built-in environments (a function that hangs costs that sample's value, never the run). A value
that is ``None`` (or a timeout, or an exception) is left out of the weighted sum. What a
function returns is checked: anything but one number or ``None`` per completion stops the run,
naming the function and the sample, since such a function would otherwise train on garbage. So
does a function that raises on every sample of a batch of two or more (a wrong signature, a
missing column), at once, before anything trains on it; one that gives no value for any sample
(it raised or timed out) stops after a few batches in a row. A function that gives every sample of a step the same value, or no value at all, is
warned about once it has done so for ``warn_constant_steps`` steps in a row: its reward
teaches nothing.

Each function's metrics are logged under its name: ``<name>/mean``, ``<name>/std`` (over its
non-``None`` values), ``<name>/none_fraction``, ``<name>/constant_steps`` (the steps in a row in
which it was constant) and its timeouts and errors.

Besides the weighted sum, ``step`` returns each function's value apart (``reward_components``,
in the order of ``functions``, named and weighted as there), for GRPO's ``advantage_estimator:
gdpo``, which normalises each reward within its group before it weighs them.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from rl_data.types import STRING_PROMPT_KEY, MessageLog
from rl_distributed.config import ConfigModel
from rl_envs.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    RewardComponents,
    check_required_metadata,
)
from rl_envs.metrics import OutcomeCounts, reward_metrics
from rl_envs.pool import Outcome, WorkerPool
from rl_envs.reward_functions import (
    BUILTIN_PRELOAD,
    ValueStats,
    check_value,
    combine,
    describe_reference,
    load_reward_function,
    reference_for,
    required_columns,
    resolve_reference,
)
from rl_envs.verifier_env import VerifierEnvConfig

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
FAILED_BATCHES_TO_STOP = 3
# A batch this large whose every sample raised stops the run at once. One sample that raised
# is no proof of a broken function (a tool environment's steps score one episode each): it
# counts towards FAILED_BATCHES_TO_STOP instead.
MIN_SAMPLES_TO_STOP_AT_ONCE = 2


class RewardFunctionSpec(ConfigModel):
    # A built-in name ("math"), "package.module:function" or "path/to/file.py:function" (a
    # relative path is taken from the directory the run starts in); from Python, the function
    # itself (kept as its import path, or pickled when it has none).
    function: str
    # Its weight in the sum of the functions' rewards.
    weight: float = Field(1.0, allow_inf_nan=False)
    name: str | None = None  # in the metrics' names; None: the built-in's or function's name
    # One call for a step's whole batch (lists of every completion, as TRL calls it) instead
    # of one call per completion; that call runs under timeout_s as a whole.
    batched: bool = False

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        # From the name as written ("math", not the path it stands for).
        if isinstance(data, dict) and data.get("name") is None and "function" in data:
            function = data["function"]
            if callable(function):
                name = getattr(function, "__name__", type(function).__name__)
            else:
                name = str(function).rpartition(":")[2]
            data = {**data, "name": name}
        return data

    @field_validator("function", mode="before")
    @classmethod
    def _callable(cls, function: Any) -> Any:
        return reference_for(function) if callable(function) else function

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
    # Warn (once per function) when a function has given every sample the same value, or no
    # value at all, for this many steps in a row: a reward that teaches nothing.
    warn_constant_steps: int = Field(3, ge=1)

    @field_validator("functions")
    @classmethod
    def _unique_names(cls, functions: list[RewardFunctionSpec]) -> list[RewardFunctionSpec]:
        names = [f.name for f in functions]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"two functions are named {repeated[0]!r}: give one a 'name'")
        return functions


def prompt_and_completion(
    log: MessageLog, meta: Mapping[str, Any] | None
) -> tuple[str | list[dict[str, str]], str, list[int] | None]:
    """The prompt as the reward functions get it (the dataset's string, if it was one, else the
    conversation before the last assistant turn, roles and contents only), that turn's text and
    its token ids (if it has them)."""
    last = max((i for i, m in enumerate(log) if m["role"] == "assistant"), default=len(log))
    prompt: str | list[dict[str, str]] = [
        {"role": m["role"], "content": m["content"]} for m in log[:last]
    ]
    if meta and isinstance(meta.get(STRING_PROMPT_KEY), str):
        prompt = meta[STRING_PROMPT_KEY]
    if last == len(log):
        return prompt, "", None
    ids = log[last].get("token_ids")
    return prompt, log[last]["content"], (None if ids is None else [int(t) for t in ids.tolist()])


def row_columns(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """A row's columns as the functions get them (without the kept string prompt)."""
    return {k: v for k, v in (meta or {}).items() if k != STRING_PROMPT_KEY}


class RewardFunctionsEnvironment(EnvironmentInterface):
    """Single-turn: one weighted reward per completion. Metadata per sample: the row's columns,
    passed to every function as keyword arguments.

    ``step`` is safe to call from several threads (a tool environment scores each episode as it
    ends), but the class does not declare ``concurrent_steps``: single-turn episodes end at
    their step, so one call per episode would only cost more calls than one per batch."""

    returns_reward_components = True

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
        # Steps in a row in which a function gave every sample one value or none (and whether
        # that was warned about).
        self.constant_steps = {f.name: 0 for f in cfg.functions}
        self.warned_constant: set[str] = set()
        # Guards everything above that steps and metrics calls update: ``step`` may run in
        # several threads at once (a tool environment scores its episodes as each ends).
        self._lock = threading.Lock()
        preload = [m for f in cfg.functions for m in BUILTIN_PRELOAD.get(f.function, ())]
        # Each function is imported when its verifier process starts, under the start-up
        # timeout: a file whose top-level code is slow must not time out every sample instead.
        preload += [f.function for f in cfg.functions if f.function not in BUILTIN_PRELOAD]
        self._pool = WorkerPool(
            "rl_envs.reward_functions:call_reward_function_on_batch",
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
        return (
            f"{self.cfg.config_key}.functions[{f}] ({spec.name}: "
            f"{describe_reference(spec.function)})"
        )

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        check_required_metadata(self, metadata)  # a missing column is no 0 reward
        n = len(message_log_batch)
        samples = [
            prompt_and_completion(log, meta)
            for log, meta in zip(message_log_batch, metadata, strict=True)
        ]
        # One job per (function, completion), each under its own timeout, spread over the
        # pool; a batched function's one job holds every completion.
        columns = [row_columns(meta) for meta in metadata]
        jobs: list[tuple] = []
        for spec in self.functions:
            if spec.batched and n:
                prompts, completions, ids = (list(x) for x in zip(*samples, strict=True))
                jobs.append((spec.function, prompts, completions, columns, ids))
            else:
                jobs += [
                    (spec.function, [prompt], [completion], [cols], [ids])
                    for (prompt, completion, ids), cols in zip(samples, columns, strict=True)
                ]
        outcomes = self._per_sample(self._pool.map(jobs) if n else [], n)
        # The functions' counts and streaks are shared by concurrent steps (a tool environment
        # scores each episode as it ends): kept under the lock, the scoring itself outside it.
        with self._lock:
            values = self._account(outcomes, samples, metadata)
        rewards = combine(values, self.weights)
        # Each function's value on its own, in the order of ``functions`` (a None as 0, as it
        # counts in the sum), for estimators that normalise each reward apart (GDPO).
        components = RewardComponents(
            names=tuple(str(f.name) for f in self.functions),
            weights=tuple(self.weights),
            values=torch.tensor(
                [[0.0 if v[i] is None else v[i] for v in values] for i in range(n)],
                dtype=torch.float32,
            ).reshape(n, len(self.functions)),
        )
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
            reward_components=components,
        )

    def _per_sample(self, outcomes: list[Outcome], n: int) -> list[Outcome]:
        """The pool's outcomes as one per (function, sample), in the functions' order: a
        batched function's one outcome split into its samples' (each value a list of one, as a
        call per completion returns), its timeout or error given to each of them."""
        out: list[Outcome] = []
        if n == 0:
            return out
        queue = iter(outcomes)
        for f, spec in enumerate(self.functions):
            if not spec.batched:
                out += [next(queue) for _ in range(n)]
                continue
            outcome = next(queue)
            if outcome.status != "ok":
                out += [outcome] * n
                continue
            value = outcome.value
            if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
                value = [value]  # check_value names what it is instead
            if len(value) != n:
                raise ValueError(
                    f"{self._where(f)} returned {len(value)} values for a batch of {n} "
                    f"completions ({value!r:.120}); a batched function returns one float or "
                    "None per completion, in order"
                )
            out += [Outcome("ok", [v]) for v in value]
        return out

    def _account(
        self,
        outcomes: list[Outcome],
        samples: list[tuple[Any, str, list[int] | None]],
        metadata: list[dict[str, Any]],
    ) -> list[list[float | None]]:
        """Each function's checked values (one per sample) from the pool's outcomes, counted
        into its metrics and streaks; the errors that stop the run raised here."""
        n = len(samples)
        values: list[list[float | None]] = []
        for f, spec in enumerate(self.functions):
            mine = outcomes[f * n : (f + 1) * n]
            errors = [(i, o.error) for i, o in enumerate(mine) if o.status == "error"]
            failed = sum(o.status != "ok" for o in mine)
            if n >= MIN_SAMPLES_TO_STOP_AT_ONCE and len(errors) == n:
                # It raised on every sample: a mistake in the function (a wrong signature, a
                # misspelt column), never a reward of 0 to train on. Stop before any training.
                raise RuntimeError(
                    f"{self._where(f)} raised on every sample of the batch ({n}), so no reward "
                    f"can come from it; sample 0 (prompt {_tail(samples[0][0])!r:.200}, "
                    f"completion {samples[0][1]!r:.200}){_hint(samples[0][0], errors[0][1])}: "
                    f"{errors[0][1]}"
                )
            self.failed_batches[spec.name] = (
                self.failed_batches[spec.name] + 1 if n and failed == n else 0
            )
            if self.failed_batches[spec.name] >= FAILED_BATCHES_TO_STOP:
                cause = errors[0][1] if errors else f"every call timed out ({self.cfg.timeout_s}s)"
                raise RuntimeError(
                    f"{self._where(f)} gave no value for any sample of {FAILED_BATCHES_TO_STOP} "
                    f"batches in a row (it raised or timed out); last batch, sample 0 (prompt "
                    f"{_tail(samples[0][0])!r:.200}): {cause}"
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
        return values

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        with self._lock:
            return self._metrics(batch)

    def _metrics(self, batch: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, float]]:
        metrics = reward_metrics(
            batch["rewards"],
            batch.get("group_ids"),
            ks=self.cfg.pass_at_k,
            success_threshold=self.cfg.success_threshold,
        )
        # Each function's values and outcomes since the last metrics call, as steps saw them.
        for f, (name, values) in enumerate(self.values.items()):
            constant = values.constant()
            if constant is not None:  # a call without samples (counts only) judges nothing
                self.constant_steps[name] = self.constant_steps[name] + 1 if constant else 0
                metrics[f"{name}/constant_steps"] = self.constant_steps[name]
                self._warn_if_constant(f, values)
            metrics.update({f"{name}/{k}": v for k, v in values.take().items()})
            metrics.update({f"{name}/{k}": v for k, v in self.counts[name].take().items()})
        return batch, metrics

    def _warn_if_constant(self, f: int, values: ValueStats) -> None:
        name = self.functions[f].name
        steps = self.constant_steps[name]
        if steps < self.cfg.warn_constant_steps or name in self.warned_constant:
            return
        self.warned_constant.add(name)
        what = (
            "no value (None or NaN) for any sample"
            if values.scored == 0
            else f"the same value ({values.low:g}) to every sample"
        )
        logger.warning(
            "%s gave %s for %d steps in a row: its reward is constant, so it teaches nothing "
            "(a function reading a completion in the wrong format, or an always-missing "
            "column?). Warned once; the metric %s/constant_steps goes on counting.",
            self._where(f),
            what,
            steps,
            name,
        )

    def shutdown(self) -> None:
        self._pool.shutdown()


def _tail(prompt: str | list[dict[str, str]]) -> Any:
    """The end of a prompt, for messages: a string as it is, a conversation's last message."""
    return prompt if isinstance(prompt, str) else prompt[-1:]


def _hint(prompt: str | list[dict[str, str]], error: str) -> str:
    """Why a function written for message lists fails on strings, when that is likely."""
    if isinstance(prompt, str) and error.startswith("TypeError") and "indices" in error:
        return (
            "; note: this dataset's prompts are strings, so prompts and completions are given "
            "as strings (TRL's standard format), not message lists"
        )
    return ""


def _show(value: float | None) -> str:
    return "None" if value is None else f"{value:g}"
