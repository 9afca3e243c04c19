"""The config reference pages: every key of every ``rl`` command's config with its type, default
and a one-line description, generated from the typed configs when the site is built.

It is an mkdocs hook (``hooks:`` in mkdocs.yml): ``on_config`` lists one page per command of
``rl_algorithms.cli.ALGORITHMS`` under "Config reference" in the nav, and ``on_files`` adds the
pages, so a new command or key appears without anyone writing a page, and no page can go stale.

Keys, defaults and descriptions come from ``rl_distributed.config.config_keys``, which
``rl <cmd> --help`` prints too: a key's description is the one on its field
(``Field(description=...)`` or the comment above it). ``uv run python docs/config_reference.py
OUT_DIR`` writes the pages to a folder, and ``tests/test_docs.py`` fails on a key without a
description.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel

from rl_distributed.config import REQUIRED, config_keys, type_name
from rl_distributed.config._describe import models_in

PAGE_DIR = "reference/config"  # under docs/
NAV_TITLE = "Config reference"


class Key(NamedTuple):
    """One row of the reference: a dotted key (``variant`` says which form of a union it is in)."""

    key: str
    type: str
    default: str
    description: str
    variant: str = ""


def _show(value: Any) -> str:
    if isinstance(value, BaseModel):  # a section of several forms: its keys follow
        return type(value).__name__
    return REQUIRED if value is REQUIRED else json.dumps(value, default=str)


def model_keys(model: type[BaseModel], recipe: Any = None, prefix: str = "") -> list[Key]:
    """The rows of ``model``'s keys: dotted key, type, default (the recipe's where it sets one)
    and description, as ``rl_distributed.config.config_keys`` lists them."""
    return [
        Key(k.key, type_name(k.annotation), _show(k.default), k.description, k.variant)
        for k in config_keys(model, recipe, prefix)
    ]


# -- pages --------------------------------------------------------------------------------------


def commands() -> dict[str, str]:
    """``{command: summary}``: the ``rl`` command's own table of algorithms."""
    from rl_algorithms.cli import ALGORITHMS

    return {name: summary for name, (_, summary) in ALGORITHMS.items()}


def command_keys(command: str) -> list[Key]:
    from omegaconf import OmegaConf

    from rl_algorithms.cli import load_algorithm
    from rl_distributed.config import load_config

    algorithm = load_algorithm(command)
    recipe = OmegaConf.to_container(load_config(algorithm.DEFAULT_RECIPE), resolve=False)
    return model_keys(algorithm.MasterConfig, recipe)


def environment_keys() -> dict[str, list[Key]]:
    """``{kind: keys of env.<task>.config}`` for each built-in environment kind."""
    import importlib

    from rl_algorithms.environments import KNOWN_ENVIRONMENTS

    out = {}
    for kind, (_, config_path) in KNOWN_ENVIRONMENTS.items():
        module, _, attr = config_path.partition(":")
        model = getattr(importlib.import_module(module), attr)
        out[kind] = model_keys(model, None, "env.<task>.config.")
    return out


def _markdown(text: str) -> str:
    """Docstring or comment text as Markdown: rST's ``code`` as `code`, no stray HTML."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(keys: list[Key]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for k in keys:
        key = f"`{k.key}`" + (f"<br>*({k.variant})*" if k.variant else "")
        lines.append(
            f"| {key} | `{_cell(k.type)}` | `{_cell(k.default)}` | "
            f"{_cell(_markdown(k.description))} |"
        )
    return lines


def command_page(command: str, summary: str) -> str:
    from rl_algorithms.cli import load_algorithm

    algorithm = load_algorithm(command)
    recipe = Path(algorithm.DEFAULT_RECIPE).name
    lines = [
        f"# `rl {command}`",
        "",
        f"{summary[:1].upper()}{summary[1:]}.",
        "",
        f"Every key of `rl {command}`'s config (`{algorithm.MasterConfig.__module__}."
        f"MasterConfig`). The defaults are those of its default recipe (`{recipe}`, shipped "
        "in `rl_algorithms/recipes/`), which every `--config` file is laid over; *required* "
        f"keys must be given. `uv run rl {command} --help` prints the same keys, "
        f"`uv run rl {command} --print-config` a run's resolved config. Generated from the "
        "typed configs when this site is built.",
    ]
    keys = command_keys(command)
    sections: dict[str, list[Key]] = {}
    for k in keys:
        sections.setdefault(k.key.split(".")[0], []).append(k)
    for section, rows in sections.items():
        field = algorithm.MasterConfig.model_fields[section]
        (model,) = models_in(field.annotation)[:1] or [None]
        doc = inspect.getdoc(model) if model is not None and model.__doc__ else ""
        lines += ["", f"## `{section}`", ""]
        if doc and model is not BaseModel:
            lines += [_markdown(" ".join(doc.split("\n\n")[0].split())), ""]
        lines += _table(rows)
    if any(k.key.startswith("env.") for k in keys):
        lines += ["", "## `env.<task>.config`, by environment kind", ""]
        lines += [
            "The `config` of an environment is checked against its kind's config when the run "
            "is set up, before any worker starts.",
        ]
        for kind, rows in environment_keys().items():
            lines += ["", f"### `kind: {kind}`", ""]
            lines += _table(rows) if rows else ["No keys."]
    return "\n".join(lines) + "\n"


def index_page() -> str:
    lines = [
        f"# {NAV_TITLE}",
        "",
        "One page per command of `rl`, each listing every config key with its type, default "
        "and description, generated from the typed configs when this site is built. Overrides "
        "use Hydra's grammar (`rl grpo grpo.seed=3 +data.system_prompt='...'`); a bad key or "
        "value fails before anything starts, naming the key.",
        "",
    ]
    lines += [f"- [`rl {name}`]({name}.md): {summary}" for name, summary in commands().items()]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    """``{path under docs/: markdown}`` of every reference page."""
    out = {f"{PAGE_DIR}/index.md": index_page()}
    for name, summary in commands().items():
        out[f"{PAGE_DIR}/{name}.md"] = command_page(name, summary)
    return out


# -- mkdocs hook --------------------------------------------------------------------------------


def on_config(config: Any) -> Any:
    """Fill the nav's empty "Config reference" entry with one page per command."""
    entries = [{"Overview": f"{PAGE_DIR}/index.md"}]
    entries += [{f"rl {name}": f"{PAGE_DIR}/{name}.md"} for name in commands()]
    for item in config["nav"] or []:
        if isinstance(item, dict) and NAV_TITLE in item:
            item[NAV_TITLE] = entries
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    return files


if __name__ == "__main__":
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "site-reference")
    for path, text in pages().items():
        target = out_dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(target)
