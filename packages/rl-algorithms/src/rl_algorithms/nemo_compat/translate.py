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


# NeMo sections configuring another model as its ``policy:`` section configures the policy:
# PPO's value model (``value:``, our ``critic:``) and distillation's ``teacher:``. Each is walked
# by the policy's own rules, re-rooted, so the two translations cannot drift apart.
MODEL_SECTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "ppo": (("value", "critic"),),
    "distill": (("teacher", "teacher"),),
}


def translate(tree: dict[str, Any], algorithm: str, source: str | None = None) -> Translation:
    """Translate a resolved NeMo RL recipe (plain data) for ``rl <algorithm>``; ``source`` is
    the recipe's file, where relative prompt files are looked for."""
    ctx = Context(tree, algorithm, source)
    for nemo, ours in MODEL_SECTIONS.get(algorithm, ()):
        if isinstance(tree.get(nemo), dict):
            _model_section(ctx, nemo, ours)
    _walk(ctx)
    return ctx.result


def _walk(ctx: Context, policy_only: bool = False) -> None:
    """Every leaf of ``ctx.tree`` not yet done, through the table; ``policy_only``: the rules
    of the ``policy`` section alone (a model section re-rooted, see :func:`_model_section`)."""

    def wanted(prefix: str) -> bool:
        return not policy_only or prefix.startswith("policy.")

    def named(key: str) -> str:  # as the recipe names it: value.X / teacher.X re-rooted
        return ctx.section + key.removeprefix("policy") if ctx.section else key

    compiled = [(pattern_regex(p), rule) for p, rule in RULES if wanted(p)]
    for prefix, flag in OFF_SECTIONS:
        if not wanted(prefix):
            continue
        if prefix in ctx.done or ctx.get(prefix) is None or ctx.get(flag, True) is not False:
            continue
        reason = f"section {named(prefix)} is off ({named(flag)}: false)"
        for key, value in ctx.leaves(prefix):
            if key != flag and key not in ctx.done:
                ctx.ignore(key, value, reason)
    for prefix, unused in UNUSED_SECTIONS:
        reason = unused(ctx)
        if reason is not None:
            for key, value in ctx.leaves(prefix):
                if key not in ctx.done:
                    ctx.ignore(key, value, reason)
    for prefix, group in GROUPS:
        if wanted(prefix) and ctx.get(prefix) is not None:
            group(ctx, prefix)
    for key, value in flatten(ctx.tree):
        if key in ctx.done:
            continue
        for regex, rule in compiled:
            match = regex.match(key)
            if match:
                _apply(ctx, rule, key, value, match.groups())
                break
        else:
            ctx.refuse(key, value, "not a NeMo RL key this translation knows; nothing here uses it")


def _model_section(ctx: Context, nemo: str, ours: str) -> None:
    """NeMo's ``<nemo>:`` section (a policy section of another model) -> our ``<ours>:``.

    The section is translated as if it were ``policy:`` and the results moved: ``policy.X``
    targets become ``<ours>.X``. The model never generates, so its ``generation`` keys (the
    teacher inherits the student's through a YAML anchor) are ignored. The critic reads the
    policy's tokens: its tokenizer keys are ignored when they equal the policy's, refused
    otherwise; the teacher's become ``teacher.tokenizer``."""
    section = dict(ctx.tree[nemo])
    for key, value in ctx.leaves(f"{nemo}.generation"):
        ctx.ignore(key, value, f"the {ours} never generates; the policy's generation does")
    section.pop("generation", None)
    sub = Context({"policy": section}, ctx.algorithm, ctx.source, section=nemo)
    _walk(sub, policy_only=True)

    def theirs(key: str) -> str:
        return nemo + key.removeprefix("policy")

    for entry in sub.result.translated:
        key, target = theirs(entry.key), entry.target or ""
        if target == "policy.max_total_sequence_length":
            # The model scores the policy's sequences, which are cut at the policy's length.
            if entry.value == ctx.get("policy.max_total_sequence_length"):
                ctx.ignore(key, entry.value, f"the {ours} scores the policy's sequences")
            else:
                ctx.refuse(key, entry.value, f"would cut the {ours}'s sequences elsewhere")
        elif target.startswith("policy."):
            ctx.record(key, entry.value, ours + target.removeprefix("policy"), entry.reason)
        elif target.startswith("tokenizer.") and ours == "critic":
            policy_value = ctx.get("policy" + entry.key.removeprefix("policy"))
            if policy_value == entry.value:
                ctx.ignore(key, entry.value, "the critic reads the policy's tokens (same value)")
            else:
                ctx.refuse(
                    key,
                    entry.value,
                    "would give the critic a tokenizer of its own; here it reads the policy's "
                    f"tokens (policy's value: {policy_value!r})",
                )
        else:
            ctx.record(key, entry.value, f"{ours}.{target}", entry.reason)
    for entry in sub.result.ignored:
        ctx.ignore(theirs(entry.key), entry.value, entry.reason)
    for entry in sub.result.refused:
        ctx.refuse(theirs(entry.key), entry.value, entry.reason)
    translated = sub.result.config
    moved = dict(translated.get("policy", {}))
    moved.pop("max_total_sequence_length", None)
    if ours == "critic" and "model" in moved:
        moved["model"] = {**moved["model"], "kind": "value"}  # a value head on that model
    if ours == "teacher" and "tokenizer" in translated:
        moved["tokenizer"] = translated["tokenizer"]
    ctx.set_ours(ours, moved)


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
