"""The ``rl`` command: ``rl sft|dpo|rm|grpo|ppo|distill|eval [--config FILE] [key=value ...]``.

A run's config is built in three layers, later ones winning: the algorithm's default recipe
(shipped in ``rl_algorithms/recipes``), the ``--config`` file (with its own ``defaults:``
parents; a mapping of it marked ``_override_: true`` replaces the one below it instead of
merging into it), and the overrides in Hydra's grammar (``a.b=1``, ``+new.key=x``, ``~drop``). The
result is resolved and validated against the algorithm's ``MasterConfig`` *before* anything
starts, so a bad key or value exits with status 2 and a message naming the key, the value and
what was expected, without a Ray cluster or worker ever starting.

Algorithms are modules named in :data:`ALGORITHMS` that follow the convention of
:mod:`rl_algorithms.config`; this command knows nothing else about them.
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ALGORITHMS: dict[str, tuple[str, str]] = {
    "sft": ("rl_algorithms.sft", "supervised fine-tuning (NLL on assistant turns)"),
    "dpo": ("rl_algorithms.dpo", "direct preference optimisation against a reference policy"),
    "rm": ("rl_algorithms.rm", "reward-model training (Bradley-Terry on preference pairs)"),
    "grpo": (
        "rl_algorithms.grpo",
        "GRPO and relatives: rollouts, rewards, clipped policy gradient",
    ),
    "ppo": ("rl_algorithms.ppo", "PPO: rollouts, a learned critic, GAE, clipped policy and value"),
    "distill": (
        "rl_algorithms.distill",
        "on-policy distillation: the student samples, a frozen teacher scores each token",
    ),
    "eval": ("rl_algorithms.eval", "pass@k and majority-vote accuracy of a model on a dataset"),
}
CONFIG_ERROR_EXIT = 2

USAGE = """usage: rl ALGORITHM [--config FILE] [key=value ...]
       rl ALGORITHM --help         the config keys of ALGORITHM: defaults, descriptions
       rl ALGORITHM --print-config  the resolved, validated config, its model, tokenizer
                                    and data files checked; nothing runs
       rl ALGORITHM --print-config --commented  the same, each key's description above it
       rl convert-config NEMO.yaml [-o OURS.yaml]  a NeMo RL recipe as a native one
A NeMo RL recipe given to --config is translated (see docs/nemo-rl.md).
Errors in the config or the data are one message; RL_TRACEBACK=1 adds the traceback."""
TRACEBACK_ENV = "RL_TRACEBACK"
INTERRUPTED_EXIT = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)


def load_algorithm(name: str) -> types.ModuleType:
    module, _ = ALGORITHMS[name]
    return importlib.import_module(module)


def build_config(
    algorithm: types.ModuleType, argv: Sequence[str], nemo: list[Any] | None = None
) -> Any:
    """Default recipe <- ``--config`` file <- overrides, validated into ``MasterConfig``.

    A NeMo RL recipe is translated first (overrides naming its keys apply to it, the others
    to ours) and its translation appended to ``nemo``, whose ``prepare`` must run before
    the algorithm does. Raises ``rl_distributed.config.ConfigError`` naming the offending key.
    """
    from omegaconf import OmegaConf

    from rl_distributed.config import apply_overrides, load_config, merge_layers, parse_cli

    path, overrides = parse_cli(argv)
    cfg = load_config(algorithm.DEFAULT_RECIPE)
    if path is None:  # an algorithm may ship a complete job to run with no --config at all
        path = getattr(algorithm, "MAIN_RECIPE", None)
    if path is not None and _nemo_recipe(path):
        translation, overrides = _translate_nemo(algorithm, path, overrides)
        if "optimizer" in translation.config.get("policy", {}):
            # NeMo's optimizer is whole in its recipe: none of our default kwargs (a weight
            # decay NeMo's recipe left out, say) may slip into it.
            cfg.policy.pop("optimizer", None)
        cfg = OmegaConf.merge(cfg, OmegaConf.create(translation.config))
        if nemo is not None:
            nemo.append(translation)
    elif path is not None:
        layer = load_config(path)
        cfg = merge_layers(_replaced_by(cfg, layer, []), layer)
    cfg = _replaced_by(cfg, None, overrides)
    overrides = [_allow_schema_keys(cfg, algorithm.MasterConfig, o) for o in overrides]
    cfg = apply_overrides(cfg, overrides)
    if path is not None and _nemo_recipe(path):
        from rl_data.datasets.base import deferred_path_checks

        # NeMo's datasets become files of ours only when the recipe runs (``prepare``), and
        # the config is validated again then, files included.
        with deferred_path_checks():
            return validate_all(cfg, algorithm.MasterConfig)
    return validate_all(cfg, algorithm.MasterConfig)


# Sections that a class of the user's own replaces whole (``loss_fn: {kind: module:Class,
# kwargs: ...}``): the default recipe's keys of the built-in loss would not fit it.
OWN_CLASS_SECTIONS = ("loss_fn",)


def _replaced_by(cfg: Any, layer: Any, overrides: list[str]) -> Any:
    """``cfg`` without the built-in keys of the sections that ``layer`` (a config file) or
    ``overrides`` give a ``kind`` of their own to. A section that already names a class of
    its own (a config file's ``loss_fn: {kind, kwargs}``) is kept: ``loss_fn.kind=...`` on
    the command line then changes the class and keeps the file's ``kwargs`` (checked against
    the new class; ``~loss_fn.kwargs`` drops them)."""
    from omegaconf import OmegaConf

    for section in OWN_CLASS_SECTIONS:
        in_layer = layer is not None and OmegaConf.select(layer, f"{section}.kind") is not None
        keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
        own_class = OmegaConf.select(cfg, f"{section}.kind") is not None
        if (in_layer or f"{section}.kind" in keys) and section in cfg and not own_class:
            cfg.pop(section)
    return cfg


def _nemo_recipe(path: str) -> bool:
    from rl_algorithms.nemo_compat import is_nemo_recipe

    return is_nemo_recipe(path)


def _translate_nemo(algorithm: types.ModuleType, path: str, overrides: list[str]) -> Any:
    """The NeMo recipe's translation (refused keys are errors, ignored ones a note on stderr)."""
    from rl_algorithms.nemo_compat import translate_file
    from rl_distributed.config import ConfigError

    name = algorithm.__name__.rsplit(".", 1)[-1]
    translation, overrides = translate_file(path, overrides, name)
    if translation.refused:
        issues = translation.refused_issues()
        lines = "\n".join(f"  {i}" for i in issues)
        raise ConfigError(
            f"NeMo RL recipe {path}: {len(issues)} key(s) ask for what is not supported here "
            f"(override them, e.g. 'key=null' or the neutral value, to go on):\n{lines}",
            issues,
        )
    print(f"rl: NeMo RL recipe {path}: {translation.summary()}", file=sys.stderr)
    print(translation.ignored_report(), file=sys.stderr)
    return translation, overrides


def _allow_schema_keys(cfg: Any, model: type, override: str) -> str:
    """``key=value`` for a key the recipe leaves out but the config model has (a default
    nobody wrote down) becomes ``++key=value``; any other override is left as it is, so a
    typo still fails with Hydra's "not in the config" and a suggestion."""
    from omegaconf import OmegaConf

    if override.startswith(("+", "~")) or "=" not in override:
        return override
    key = override.split("=", 1)[0]
    found = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_resolution_failure=False)
    if found is not _ABSENT:
        return override
    return f"++{override}" if _schema_has(model, key.split(".")) else override


_ABSENT = object()


def _schema_has(model: Any, parts: list[str]) -> bool:
    """Whether the typed config has the key ``parts`` (in any form of a section that has
    several: ``generation.vllm.*`` is a key of the vllm backend's)."""
    from rl_distributed.config._describe import single_model, variants_of

    annotation = model
    for part in parts:
        section = single_model(annotation)
        if section is None:
            return False
        forms = [m for m in variants_of(section) if part in m.model_fields]
        if not forms:
            return False
        annotation = forms[0].model_fields[part].annotation
    return True


def validate_all(cfg: Any, model: type) -> Any:
    """``validate_config``, but reporting every problem at once: keys still set to ``???``
    (never given) are listed after the keys with bad values, instead of hiding them."""
    from omegaconf import OmegaConf

    from rl_distributed.config import ConfigError, ConfigIssue, validate_config

    missing = _mandatory_keys(OmegaConf.to_container(cfg, resolve=False))
    pruned = cfg.copy()
    for key in missing:
        parent_key, _, last = key.rpartition(".")
        parent = OmegaConf.select(pruned, parent_key) if parent_key else pruned
        del parent[last]
    try:
        typed = validate_config(pruned, model)
    except ConfigError as e:
        if not e.errors:  # not a validation error (e.g. a bad interpolation)
            raise
        # a key never given also upsets the checks of the sections holding it: report it once
        issues = [
            i
            for i in e.errors
            if i.key not in missing and not any(k.startswith(f"{i.key}.") for k in missing)
        ]
    else:
        if not missing:
            return typed
        issues = []
    issues += [
        ConfigIssue(key, "mandatory", f"required value never set (pass '{key}=...')")
        for key in missing
    ]
    issues.sort(key=lambda i: i.kind in ("missing", "mandatory"))  # bad values first
    lines = "\n".join(f"  {issue}" for issue in issues)
    n = len(issues)
    raise ConfigError(
        f"Invalid config for {model.__name__} ({n} problem{'s' * (n != 1)}):\n{lines}", issues
    )


def _mandatory_keys(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = enumerate(tree)
    else:
        return []
    out = []
    for key, value in items:
        if value == "???":
            out.append(f"{prefix}{key}")
        else:
            out += _mandatory_keys(value, f"{prefix}{key}.")
    return out


def print_all(text: str) -> int:
    """Write ``text`` to standard output; a reader that stops early (``rl grpo --help | head``)
    ends the output quietly, not with a BrokenPipeError traceback and a failing exit."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rl`` console script (also callable in-process with ``argv``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_overview())
        return 0
    name, rest = args[0], args[1:]
    if name == "convert-config":
        from rl_algorithms.nemo_compat.convert import main as convert_main

        return convert_main(rest)
    if name not in ALGORITHMS:
        print(
            f"rl: unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}",
            file=sys.stderr,
        )
        print(USAGE, file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        algorithm = load_algorithm(name)
    except ModuleNotFoundError as e:
        if e.name != ALGORITHMS[name][0]:
            raise
        print(f"rl: the {name!r} algorithm is not part of this installation", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    if "-h" in rest or "--help" in rest:
        return print_all(describe(name, algorithm) + "\n")
    print_only = "--print-config" in rest
    commented = "--commented" in rest
    rest = [a for a in rest if a not in ("--print-config", "--commented")]

    from rl_distributed.config import ConfigError, to_yaml

    nemo: list[Any] = []
    try:
        config = build_config(algorithm, rest, nemo)
    except ConfigError as e:
        return _user_error(name, e)
    from rl_algorithms.checks import InputError, NothingToDo, check_inputs

    if print_only:
        from rl_distributed.config import commented_yaml

        if not nemo:  # a NeMo recipe's models and data are in place only once it runs
            try:
                check_inputs(config)
            except InputError as e:
                return _user_error(name, e)
        return print_all(commented_yaml(config) if commented else to_yaml(config))
    try:
        for translation in nemo:  # hub ids to local models, NeMo's datasets to our files
            config = translation.prepare(config)
        if nemo:  # now with its data files in place
            from omegaconf import OmegaConf

            dumped = OmegaConf.create(config.model_dump(mode="json"))
            config = validate_all(dumped, algorithm.MasterConfig)
    except (FileNotFoundError, ConfigError) as e:
        return _user_error(name, e)
    from rl_algorithms.utils.checkpoint import CheckpointOfAnotherRun
    from rl_data.errors import DataError
    from rl_distributed.virtual_cluster import use_plain_output

    _save_resolved(config)
    use_plain_output(sys.stdout)  # `rl grpo > log.txt`: no colour codes, no redrawn bars
    try:
        algorithm.main(config)
    except NothingToDo as e:
        print(f"rl {name}: {e}", file=sys.stderr)
    except (InputError, DataError, CheckpointOfAnotherRun) as e:
        # Files the config points at, checked before Ray starts; a bad row past the checked
        # sample; or a checkpoint_dir of another run (before Ray starts too).
        return _user_error(name, e)
    except BaseException as e:
        if not _interrupted(e):
            raise
        print(f"rl {name}: {interrupted_message(config)}", file=sys.stderr)
        return INTERRUPTED_EXIT
    return 0


def _user_error(name: str, error: BaseException) -> int:
    """One message for a mistake in the user's config or data; the traceback too only when
    RL_TRACEBACK is set (it shows this program's code, not the mistake)."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        raise error
    print(f"rl {name}: {error}", file=sys.stderr)
    return CONFIG_ERROR_EXIT


def _interrupted(error: BaseException | None) -> bool:
    """Whether ``error`` is Ctrl-C, or an error raised while shutting down after it."""
    while error is not None:
        if isinstance(error, KeyboardInterrupt):
            return True
        error = error.__context__
    return False


def interrupted_message(config: Any, step: int | None = None) -> str:
    """Where an interrupted run stopped (``step``: steps done, default the last run's) and
    where the same command resumes it: its latest checkpoint, if it has one."""
    from rl_algorithms.run import last_run
    from rl_algorithms.utils.checkpoint import CheckpointManager, read_info

    if step is None:
        run = last_run()
        step = run.step if run is not None else None
    where = "before the first step" if step is None else f"at step {step}"
    checkpointing = getattr(config, "checkpointing", None)
    if checkpointing is None or not checkpointing.enabled:
        return f"interrupted {where}; checkpointing is off, so a rerun starts from the start"
    latest = CheckpointManager(checkpointing).latest()
    resume = "the start" if latest is None else f"step {read_info(latest)['step']}"
    return f"interrupted {where}; rerun the same command to resume from {resume}"


def _save_resolved(config: Any) -> None:
    """The resolved config next to the logs, for reproducibility."""
    from rl_distributed.config import save_config

    log_dir = getattr(getattr(config, "logger", None), "log_dir", None)
    if log_dir is not None:
        save_config(config, Path(log_dir) / "config.yaml")


# -- help ----------------------------------------------------------------------------------------


def _overview() -> str:
    lines = [USAGE, "", "algorithms:"]
    lines += [f"  {name:<6} {summary}" for name, (_, summary) in ALGORITHMS.items()]
    lines += ["", "config groups (each algorithm's --help lists its keys):"]
    groups: dict[str, list[str]] = {}
    for name in ALGORITHMS:
        try:
            model = load_algorithm(name).MasterConfig
        except ModuleNotFoundError:
            continue
        for group in model.model_fields:
            groups.setdefault(group, []).append(name)
    lines += [f"  {group:<14} used by {', '.join(users)}" for group, users in groups.items()]
    lines += [
        "",
        "overrides: a.b=1 changes a key, +a.b=1 adds one, ++a.b=1 adds or changes, ~a.b deletes.",
        "Re-running with the same checkpointing.checkpoint_dir resumes from its latest checkpoint",
        "(refused if it was written with another model, tokenizer or training data).",
    ]
    return "\n".join(lines)


def describe(name: str, algorithm: types.ModuleType) -> str:
    """``rl NAME --help``: every key of the algorithm's config with its type, default (the
    default recipe's) and description, as the docs' config reference lists them."""
    from omegaconf import OmegaConf

    from rl_distributed.config import config_keys, load_config, type_name

    defaults = OmegaConf.to_container(load_config(algorithm.DEFAULT_RECIPE), resolve=False)
    lines = [
        USAGE.replace("ALGORITHM", name, 1).splitlines()[0],
        "",
        f"{ALGORITHMS[name][1]}.",
        f"default recipe: {algorithm.DEFAULT_RECIPE}",
        *(
            [
                f"without --config, `rl {name}` runs {main} on top of it (its values are not "
                "the defaults below; --print-config shows them)"
            ]
            if (main := getattr(algorithm, "MAIN_RECIPE", None)) is not None
            else []
        ),
        "",
        "config keys (type = default; 'required' must be given), each with its description:",
    ]
    shown: list[str] = []  # the sections whose header is printed, outermost first
    for key in config_keys(algorithm.MasterConfig, defaults):
        *sections, leaf = key.key.split(".")
        common = next(
            (i for i, (a, b) in enumerate(zip(shown, sections, strict=False)) if a != b),
            min(len(shown), len(sections)),
        )
        shown = shown[:common]
        for section in sections[common:]:
            lines.append(f"{'  ' * len(shown)}{section}:")
            shown.append(section)
        indent = "  " * len(sections)
        variant = f"  [{key.variant}]" if key.variant else ""
        lines.append(
            f"{indent}{leaf}: {type_name(key.annotation)} = {_default(key.default)}{variant}"
        )
        if key.description:
            lines += textwrap.wrap(
                key.description,
                100,
                initial_indent=indent + "    ",
                subsequent_indent=indent + "    ",
            )
    return "\n".join(lines)


def _default(value: Any) -> str:
    from pydantic import BaseModel

    from rl_distributed.config import REQUIRED

    if value is REQUIRED:
        return REQUIRED
    if isinstance(value, BaseModel):  # a section of several forms: its keys follow
        return type(value).__name__
    return repr(value)


if __name__ == "__main__":
    sys.exit(main())
