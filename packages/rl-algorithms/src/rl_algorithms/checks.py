"""The user's input checked before anything starts: by ``rl ALGORITHM --print-config``, and by
every run before its tokenizer, data or Ray cluster are loaded or started.

Config validation checks keys and values; these checks read what the keys point at, with the
loaders a run uses:

- every model and tokenizer path (``policy.model.path``, ``tokenizer.path``, a critic's or
  teacher's, their ``gguf_file``): a local directory or file that exists, or a hub id found in
  the local Hugging Face cache (models are never downloaded);
- every file dataset (``data.train``, ``data.validation``): its first :data:`SAMPLE_ROWS`
  records are read and converted as a run does, so a line that is not JSON or a row without
  a prompt column is reported with its file and row;
- with environments configured (``env``), that each sampled row's ``task_name`` has one and
  that its ``extra_env_info`` holds every column the environment's reward reads (for reward
  functions, each argument of theirs without a default that is not one TRL passes).

A run still reads all of its data when it starts, with the same checks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

#: Records read from each file dataset by the checks (all of a smaller one).
SAMPLE_ROWS = 1000


class InputError(ValueError):
    """What the checks found, one problem a line, each naming the key, file or row."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        n = len(problems)
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"the run's input has {n} problem{'s' * (n != 1)}:\n{lines}")


def check_inputs(config: Any, data: bool = True) -> None:
    """Check what ``config`` (a validated ``MasterConfig``) points at: its models and
    tokenizers, and its data files unless ``data`` is False (a run handed its rows). Raises
    :class:`InputError` listing every problem found. Starts nothing."""
    problems = model_problems(config) + (data_problems(config) if data else [])
    if problems:
        raise InputError(problems)


def model_problems(config: Any) -> list[str]:
    """A line for each model or tokenizer section whose files are not there."""
    from rl_data.tokenizers import TokenizerConfig, tokenizer_files
    from rl_models.model_files import gguf_path, resolve_model_path
    from rl_models.modeling.config import ModelConfig

    problems: list[str] = []
    for key, section in _sections(config):
        try:
            if isinstance(section, ModelConfig) and section.gguf_file is not None:
                key += ".gguf_file"
                gguf_path(section)
            elif isinstance(section, ModelConfig) and section.path is not None:
                key += ".path"
                resolve_model_path(section.path)
            elif isinstance(section, TokenizerConfig):
                key += ".gguf_file" if section.gguf_file is not None else ".path"
                tokenizer_files(section)
        except FileNotFoundError as e:
            reason = str(e).removeprefix("model.gguf_file: ")
            problems.append(f"{key}: {reason}")
    return problems


def _sections(model: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, section)`` for every config section below ``model``, outermost first."""
    from pydantic import BaseModel

    for name in type(model).model_fields:
        value = getattr(model, name, None)
        if isinstance(value, BaseModel):
            yield f"{prefix}{name}", value
            yield from _sections(value, f"{prefix}{name}.")


def data_problems(config: Any) -> list[str]:
    """A line for each file dataset whose first :data:`SAMPLE_ROWS` records do not load, or
    do not hold what the environments read."""
    from rl_data.datasets import load_dataset, sampled_rows
    from rl_data.datasets.chat import FileSourceConfig

    data = getattr(config, "data", None)
    envs = getattr(config, "env", None) or {}
    problems: list[str] = []
    for split in ("train", "validation"):
        source = getattr(data, split, None)
        if not isinstance(source, FileSourceConfig):
            continue  # generated data (arithmetic, reasoning_gym) is checked by the config
        try:
            with sampled_rows(SAMPLE_ROWS):
                rows = load_dataset(source)
            if envs:
                check_rows_for_envs(rows, envs)
        except ValueError as e:  # a DataError names the file and row
            problems.append(f"data.{split}: {e}")
    return problems


def check_rows_for_envs(rows: Any, envs: Mapping[str, Any]) -> None:
    """Every row's ``task_name`` has an environment, and its ``extra_env_info`` the columns
    that environment's reward reads: a row without them would fail mid-step, or score 0
    forever with nothing saying why. Raises a ``DataError`` naming the file and row."""
    from rl_algorithms.environments import required_metadata
    from rl_data.datasets import require_env_info
    from rl_data.errors import DataError

    for i in range(len(rows)):
        task = rows[i].get("task_name")
        if task not in envs:
            source, n = rows.origin(i)
            raise DataError(
                f"task_name {task!r} has no environment (env configures only {sorted(envs)}): "
                f"add env.{task} or set the data's task_name",
                source,
                n,
            )
    require_env_info(rows, {task: required_metadata(task, spec) for task, spec in envs.items()})
    check_offered_tools(rows, envs)


def check_offered_tools(rows: Any, envs: Mapping[str, Any]) -> None:
    """A row's ``tools`` column offers only tools its environment has (the model would call
    a tool that nobody runs). Raises a ``DataError`` naming the file, row and tool."""
    from rl_algorithms.environments import offered_tools
    from rl_data.errors import DataError
    from rl_data.types import TOOLS_KEY

    has = {
        task: {t["function"]["name"] for t in tools} for task, tools in offered_tools(envs).items()
    }
    for i in range(len(rows)):
        row = rows[i]
        names = has.get(row.get("task_name"))
        offered = (row.get("extra_env_info") or {}).get(TOOLS_KEY)
        if names is None or offered is None:
            continue
        unknown = sorted({t["function"]["name"] for t in offered} - names)
        if unknown:
            source, n = rows.origin(i)
            raise DataError(
                f"its tools column offers {unknown}, which env.{row['task_name']} does not "
                f"have (its tools: {sorted(names)})",
                source,
                n,
            )


class NothingToDo(Exception):
    """A rerun of a run that is finished: its latest checkpoint is at its last step."""


def refuse_finished_run(
    done: int, total: int, config: Any, checkpoint: Any, limit: str = "max_num_steps"
) -> None:
    """Raise :class:`NothingToDo` when the checkpoint's step ``done`` has reached the run's
    ``total`` steps (set by the loop section's ``limit`` key), naming the key to raise."""
    if done < total:
        return
    key = next(
        (f"{name}.{limit}" for name, s in _sections(config) if limit in type(s).model_fields),
        limit,
    )
    raise NothingToDo(
        f"nothing to do: the checkpoint {checkpoint} already reached step {done} of {total}; "
        f"raise {key} to continue"
    )
