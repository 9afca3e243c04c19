"""``rl convert-config NEMO.yaml [-o OURS.yaml] [--algorithm grpo|ppo|distill|sft|dpo|rm]``.

Writes the translated recipe as a native one: each translated key with a comment naming the
NeMo key(s) it came from, then every ignored or refused NeMo key, commented out with its value
and the reason, so nothing is dropped without a word. The output is plain YAML (values are
written by PyYAML, one ``key: value`` per line, lists and mappings inline), which
``rl <algo> --config`` reads like any recipe.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import yaml

from rl_algorithms.nemo_compat.translate import Translation, translate_file

USAGE = (
    "usage: rl convert-config NEMO.yaml [-o OURS.yaml] [--algorithm grpo|ppo|distill|sft|dpo|rm]"
)
# NeMo's loop section -> our algorithm (``rl <name>``).
ALGORITHM_SECTIONS = {
    "grpo": "grpo",
    "ppo": "ppo",
    "distillation": "distill",
    "sft": "sft",
    "dpo": "dpo",
    "rm": "rm",
}


def guess_algorithm(tree: dict[str, Any]) -> str:
    found = [a for s, a in ALGORITHM_SECTIONS.items() if s in tree]
    if len(found) != 1:
        raise ValueError(
            f"cannot tell the algorithm from the recipe (sections found: {found or 'none'}); "
            "pass --algorithm"
        )
    return found[0]


def render(translation: Translation, source: str) -> str:
    """The native recipe, commented."""
    by_note: dict[str, dict[str, list[str]]] = {}
    for e in translation.translated:
        by_note.setdefault(e.target or "", {}).setdefault(e.reason, []).append(e.key)
    origins = {
        target: [", ".join(keys) + (f" ({note})" if note else "") for note, keys in notes.items()]
        for target, notes in by_note.items()
    }
    lines = [
        f"# Translated from the NeMo RL recipe {source} by `rl convert-config`.",
        f"# {translation.summary()}; dropped keys are listed at the end.",
        f"# Run with: rl {translation.algorithm} --config <this file>",
    ]
    if translation.data_jobs:
        lines.append(
            "# The data files named below are written by `rl` when it runs the NeMo recipe "
            "itself; run that once, or write them yourself."
        )
    lines += _emit(translation.config, "", origins, 0)
    for title, entries in (("ignored", translation.ignored), ("refused", translation.refused)):
        if entries:
            lines += ["", f"# -- NeMo RL keys {title} ({len(entries)}) --"]
            lines += [f"# {e.key}: {_flow(e.value)}  -- {e.reason}" for e in entries]
    return "\n".join(lines) + "\n"


def _emit(tree: dict[str, Any], prefix: str, origins: dict[str, list[str]], depth: int) -> list:
    out = []
    pad = "  " * depth
    for key, value in tree.items():
        full = f"{prefix}{key}"
        comment = _comment(full, origins)
        if isinstance(value, dict) and value:
            out.append(f"{pad}{key}:{comment}")
            out += _emit(value, f"{full}.", origins, depth + 1)
        else:
            out.append(f"{pad}{key}: {_flow(value)}{comment}")
    return out


def _comment(key: str, origins: dict[str, list[str]]) -> str:
    # Several NeMo keys may feed one of ours (Megatron's optimizer section); list them all.
    names = origins.get(key)
    if not names:
        return ""
    return "  # from " + "; ".join(names)


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False)
    return text.strip().removesuffix("...").strip()


def main(argv: Sequence[str]) -> int:
    """Entry point of ``rl convert-config``."""
    from omegaconf import OmegaConf

    from rl_distributed.config import ConfigError, load_config

    args = list(argv)
    if not args or "-h" in args or "--help" in args:
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 0 if args else 2
    out, algorithm = None, None
    positional = []
    while args:
        arg = args.pop(0)
        if arg in ("-o", "--output", "--algorithm") and args:
            value = args.pop(0)
            out, algorithm = (value, algorithm) if arg != "--algorithm" else (out, value)
        else:
            positional.append(arg)
    if len(positional) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    source = positional[0]
    try:
        if algorithm is None:
            tree = OmegaConf.to_container(load_config(source), resolve=False)
            algorithm = guess_algorithm(tree)
        translation, _ = translate_file(source, [], algorithm)
    except (ConfigError, ValueError) as e:
        print(f"rl convert-config: {e}", file=sys.stderr)
        return 2
    text = render(translation, source)
    if out is None:
        sys.stdout.write(text)
    else:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"rl convert-config: {translation.summary()}", file=sys.stderr)
    if translation.refused:
        # The file is written (refused keys listed in it), but it does not do what the NeMo
        # recipe does: say so in the exit status too.
        print(
            f"rl convert-config: {len(translation.refused)} NeMo key(s) refused; the written "
            "recipe leaves them out (see its end)",
            file=sys.stderr,
        )
        return 2
    return 0
