"""The config reference pages: every key of every ``rl`` command's config with its type, default
and a one-line description, generated from the typed configs when the site is built.

It is an mkdocs hook (``hooks:`` in mkdocs.yml): ``on_config`` lists one page per command of
``rl_algorithms.cli.ALGORITHMS`` under "Config reference" in the nav, and ``on_files`` adds the
pages, so a new command or key appears without anyone writing a page, and no page can go stale.

Descriptions come from the source of the config classes, the way their authors write them:
``Field(description=...)`` if given, else the ``#`` comment lines just above the field, else the
comment at the end of its line; a field a subclass redeclares without a comment keeps its
parent's. ``uv run python docs/config_reference.py OUT_DIR`` writes the pages to a folder, and
``tests/test_docs.py`` fails on a key without a description (bar the few listed there).
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel

PAGE_DIR = "reference/config"  # under docs/
NAV_TITLE = "Config reference"


class Key(NamedTuple):
    """One row of the reference: a dotted key (``variant`` says which form of a union it is in)."""

    key: str
    type: str
    default: str
    description: str
    variant: str = ""


# -- descriptions, read from the source --------------------------------------------------------


@functools.cache
def _source_descriptions(cls: type) -> dict[str, str]:
    """``{field: its comment}`` for the fields ``cls`` itself declares, from its source."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    source = textwrap.dedent("".join(lines))
    comments: dict[int, str] = {}  # line number (1-based, in `source`) -> comment text
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    text_lines = source.splitlines()
    (class_node,) = ast.parse(source).body
    out: dict[str, str] = {}
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        line = node.lineno - 1
        while line >= 1 and text_lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        inline = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        text = " ".join(above) or " ".join(inline)
        text = re.sub(r"\s+", " ", text).strip()
        if text and not text.startswith(("fmt:", "noqa", "type:")):
            out[node.target.id] = text
    return out


SUPPLEMENT = Path(__file__).with_name("config_descriptions.yaml")


@functools.cache
def supplement() -> dict[str, dict[str, str]]:
    """``{"module:Class": {field: description}}`` for fields whose source says nothing."""
    import yaml

    return yaml.safe_load(SUPPLEMENT.read_text()) or {}


def class_id(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def declaring_classes(model: type[BaseModel], name: str) -> list[type]:
    """The classes of ``model``'s MRO that declare ``name``, the subclass first."""
    return [c for c in model.__mro__ if name in vars(c).get("__annotations__", {})]


def source_description(model: type[BaseModel], name: str) -> str:
    """What the source says about ``model.name``: ``Field(description=...)`` or comments."""
    given = model.model_fields[name].description
    if given:
        return " ".join(given.split())
    for cls in declaring_classes(model, name):
        found = _source_descriptions(cls).get(name)
        if found:
            return found
    return ""


def field_description(model: type[BaseModel], name: str) -> str:
    """The description of ``model.name``: the source's, else config_descriptions.yaml's
    (empty if neither says anything)."""
    found = source_description(model, name)
    for cls in declaring_classes(model, name):
        found = found or supplement().get(class_id(cls), {}).get(name, "")
    return found


# -- types and defaults ----------------------------------------------------------------------


def _unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (directly, in a union, a list or a dict)."""
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        for model in _models_in(arg):
            if model not in found:
                found.append(model)
    return found


def _is_single_model(annotation: Any) -> bool:
    """``Model`` or ``Model | None``: a nested section whose keys are listed one by one."""
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return len(args) == 1 and _is_single_model(args[0])
    return False


def type_name(annotation: Any) -> str:
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    text = repr(annotation).replace("typing.", "")
    text = re.sub(r"Annotated\[(.*?), [A-Za-z]+\(.*?\)\]", r"\1", text)
    text = re.sub(r"\b(?:[a-z_][\w]*\.)+([A-Za-z_]\w*)", r"\1", text)  # module paths
    text = re.sub(r"Optional\[(.*)\]$", r"\1 | None", text)
    return text


def _show(value: Any) -> str:
    if value == "???":
        return "required"
    return json.dumps(value, default=str)


def _variant_label(model: type[BaseModel]) -> str:
    """``source: chat_file`` for a member of a union told apart by a one-value Literal."""
    for name, field in model.model_fields.items():
        annotation = _unwrap(field.annotation)
        if (
            typing.get_origin(annotation) is typing.Literal
            and len(typing.get_args(annotation)) == 1
        ):
            return f"{name}: {typing.get_args(annotation)[0]}"
    return model.__name__


def model_keys(
    model: type[BaseModel], recipe: Any = None, prefix: str = "", variant: str = ""
) -> list[Key]:
    """The keys of ``model`` (nested sections flattened to dotted keys), with defaults from
    ``recipe`` where it sets them, else from the model."""
    out: list[Key] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        in_recipe = isinstance(recipe, dict) and name in recipe
        value = recipe.get(name) if isinstance(recipe, dict) else None
        if _is_single_model(field.annotation):
            (nested,) = _models_in(field.annotation)
            out += model_keys(nested, value, f"{key}.", variant)
            continue
        if in_recipe:
            default = _show(value)
        elif field.is_required():
            default = "required"
        else:
            default = _show(field.get_default(call_default_factory=True))
        out.append(
            Key(key, type_name(field.annotation), default, field_description(model, name), variant)
        )
        members = _models_in(field.annotation)
        annotation = _unwrap(field.annotation)
        if members and typing.get_origin(annotation) is dict:
            for member in members:  # a mapping of named sections (e.g. env.<task>)
                out += model_keys(member, None, f"{key}.<name>.", variant)
        else:
            for member in members:  # one form of a union (e.g. data.train by its source)
                label = _variant_label(member)
                chosen = value if isinstance(value, dict) else None
                if chosen is not None and label != member.__name__:
                    tag, _, tag_value = label.partition(": ")
                    if str(chosen.get(tag)) != tag_value:
                        chosen = None
                out += model_keys(member, chosen, f"{key}.", label)
    return out


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
        (model,) = _models_in(field.annotation)[:1] or [None]
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
