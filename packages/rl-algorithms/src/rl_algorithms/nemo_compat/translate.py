"""Walking a NeMo RL recipe leaf by leaf through the key table (:mod:`.rules`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_algorithms.nemo_compat.core import (
    Call,
    Context,
    Ignore,
    Refuse,
    Rule,
    Translation,
    Unless,
    flatten,
)
from rl_algorithms.nemo_compat.rules import GROUPS, OFF_SECTIONS, RULES, UNUSED_SECTIONS

# Keys only NeMo RL's recipes have: one of them marks a file as a NeMo recipe.
NEMO_MARKERS = (
    "policy.model_name",
    "policy.dtensor_cfg",
    "policy.megatron_cfg",
    "policy.generation",
    "policy.precision",
)


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """``a.*.b`` (``*`` one segment, or part of one: ``moe_*``) and ``a.**`` (the rest)."""
    parts = []
    for segment in pattern.split("."):
        if segment == "**":
            parts.append(r"(.+)")
        else:
            parts.append(r"([^.]*)".join(re.escape(p) for p in segment.split("*")))
    return re.compile(r"\.".join(parts) + r"\Z")


def translate(tree: dict[str, Any], algorithm: str, source: str | None = None) -> Translation:
    """Translate a resolved NeMo RL recipe (plain data) for ``rl <algorithm>``; ``source`` is
    the recipe's file, where relative prompt files are looked for."""
    ctx = Context(tree, algorithm, source)
    compiled = [(pattern_regex(p), rule) for p, rule in RULES]
    for prefix, flag in OFF_SECTIONS:
        if prefix in ctx.done or ctx.get(prefix) is None or ctx.get(flag, True) is not False:
            continue
        for key, value in ctx.leaves(prefix):
            if key != flag and key not in ctx.done:
                ctx.ignore(key, value, f"section {prefix} is off ({flag}: false)")
    for prefix, unused in UNUSED_SECTIONS:
        reason = unused(ctx)
        if reason is not None:
            for key, value in ctx.leaves(prefix):
                if key not in ctx.done:
                    ctx.ignore(key, value, reason)
    for prefix, group in GROUPS:
        if ctx.get(prefix) is not None:
            group(ctx, prefix)
    for key, value in flatten(tree):
        if key in ctx.done:
            continue
        for regex, rule in compiled:
            match = regex.match(key)
            if match:
                _apply(ctx, rule, key, value, match.groups())
                break
        else:
            ctx.refuse(key, value, "not a NeMo RL key this translation knows; nothing here uses it")
    return ctx.result


def _apply(ctx: Context, rule: Rule, key: str, value: Any, groups: Sequence[str]) -> None:
    if isinstance(rule, Ignore):
        ctx.ignore(key, value, rule.reason)
    elif isinstance(rule, Unless):
        neutral = rule.neutral(value, ctx) if callable(rule.neutral) else value in rule.neutral
        if neutral:
            ctx.ignore(key, value, f"no effect at this value (otherwise: {rule.would})")
        else:
            ctx.refuse(key, value, f"would {rule.would}; not supported here")
    elif isinstance(rule, Call):
        try:
            rule.fn(ctx, key, value)
        except Refuse as e:
            ctx.refuse(key, value, str(e))
    else:
        try:
            converted = rule.convert(value, ctx) if rule.convert else None
        except Refuse as e:
            ctx.refuse(key, value, str(e))
            return
        ctx.put(key, value, rule.target.format(*groups), rule.note, ours=converted)


def is_nemo_recipe(path: str | Path) -> bool:
    """Whether the file (with its ``defaults:`` parents) has a key only NeMo RL recipes have."""
    from omegaconf import OmegaConf

    from rl_distributed.config import load_config

    cfg = load_config(path)
    return any(
        OmegaConf.select(cfg, k, default=None, throw_on_resolution_failure=False) is not None
        for k in NEMO_MARKERS
    )


def translate_file(
    path: str | Path, overrides: Sequence[str], algorithm: str
) -> tuple[Translation, list[str]]:
    """Load a NeMo recipe (its ``defaults:`` chain too), apply the overrides that name its own
    keys, resolve its interpolations, and translate. Returns the translation and the overrides
    left for our config (those naming keys the NeMo recipe does not have)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rl_distributed.config import (
        ConfigError,
        apply_overrides,
        drop_override_markers,
        load_config,
    )

    cfg = load_config(path)
    theirs, ours = [], []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        found = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_resolution_failure=False)
        (theirs if found is not _ABSENT else ours).append(override)
    cfg = apply_overrides(cfg, theirs)
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: key '{e.full_key}': {str(e).splitlines()[0]}") from None
    assert isinstance(tree, dict)
    drop_override_markers(tree)  # NeMo's too: they told the recipe's merge what to do
    return translate(tree, algorithm, str(path)), ours


_ABSENT = object()
