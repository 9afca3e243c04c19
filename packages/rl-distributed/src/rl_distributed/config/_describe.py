"""Every key of a config model, with its type, default and description: what ``rl <cmd>
--help``, the docs' config reference and commented recipes are all made from.

A key's description lives in one place, on its field: ``Field(description=...)``, else the
``#`` comment lines just above the field, else the comment at the end of its line; a field a
subclass redeclares without one keeps its parent's. Comments are read from the source when
first asked for (one parse per module), not at import.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel

#: The default of a key that has none: it must be given.
REQUIRED = "required"


class Key(NamedTuple):
    """One key: a dotted path (``<name>`` for any key of a mapping) and what it holds.
    ``variant`` says which form of its section it belongs to (``backend: vllm``)."""

    key: str
    annotation: Any
    default: Any  # REQUIRED when it must be given
    description: str
    variant: str = ""


# -- descriptions ----------------------------------------------------------------------------


def _comments_of_class(node: ast.ClassDef, comments: dict[int, str], lines: list[str]) -> dict:
    out: dict[str, str] = {}
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        above = []
        line = item.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        end = item.end_lineno or item.lineno
        inline = [comments[n] for n in range(item.lineno, end + 1) if n in comments]
        text = re.sub(r"\s+", " ", " ".join(above) or " ".join(inline)).strip()
        if text and not text.startswith(("fmt:", "noqa", "type:")):
            out[item.target.id] = text
    return out


def _parse(source: str) -> tuple[ast.Module, dict[int, str], list[str]]:
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    return ast.parse(source), comments, source.splitlines()


@functools.cache
def _module_comments(filename: str) -> dict[str, dict[str, str]]:
    """``{class qualname: {field: comment}}`` for the classes of a module's top level (and
    classes nested in them), from one parse of its file."""
    try:
        with open(filename, encoding="utf-8") as f:
            tree, comments, lines = _parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    out: dict[str, dict[str, str]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                out[prefix + node.name] = _comments_of_class(node, comments, lines)
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return out


@functools.cache
def _source_comments(cls: type) -> dict[str, str]:
    """``{field: its comment}`` for the fields ``cls`` itself declares."""
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    if filename and "<locals>" not in cls.__qualname__:
        found = _module_comments(filename).get(cls.__qualname__)
        if found is not None:
            return found
    try:  # a class made in a function (a test's): its own source
        lines, _ = inspect.getsourcelines(cls)
        tree, comments, text_lines = _parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return {}
    (node,) = tree.body
    return _comments_of_class(node, comments, text_lines) if isinstance(node, ast.ClassDef) else {}


def declaring_classes(model: type[BaseModel], name: str) -> list[type]:
    """The classes of ``model``'s MRO that declare ``name``, the subclass first."""
    return [c for c in model.__mro__ if name in vars(c).get("__annotations__", {})]


def field_description(model: type[BaseModel], name: str) -> str:
    """The description of ``model.name`` (see the module docstring); empty if it has none."""
    given = model.model_fields[name].description
    if given:
        return " ".join(given.split())
    for cls in declaring_classes(model, name):
        found = _source_comments(cls).get(name)
        if found:
            return found
    return ""


# -- keys ------------------------------------------------------------------------------------


def unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (directly, in a union, a list or a dict)."""
    annotation = unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        for model in models_in(arg):
            if model not in found:
                found.append(model)
    return found


def single_model(annotation: Any) -> type[BaseModel] | None:
    """``Model`` or ``Model | None``: a nested section whose keys are listed one by one."""
    annotation = unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return single_model(args[0])
    return None


def variants_of(model: type[BaseModel]) -> list[type[BaseModel]]:
    """The forms a section typed ``model`` can take (one per backend of a backend-chosen
    section, see ``config_variants``); ``[model]`` for a plain one."""
    variants = getattr(model, "config_variants", None)
    return list(variants()) if variants is not None else [model]


def variant_label(model: type[BaseModel]) -> str:
    """``source: chat_file`` for a form of a union told apart by a one-value Literal."""
    for name, field in model.model_fields.items():
        annotation = unwrap(field.annotation)
        if (
            typing.get_origin(annotation) is typing.Literal
            and len(typing.get_args(annotation)) == 1
        ):
            return f"{name}: {typing.get_args(annotation)[0]}"
    return model.__name__


def _chosen(recipe: Any, label: str, default_label: str) -> Any:
    """``recipe`` when it is the form ``label`` names (by its tag, or the default form)."""
    if not isinstance(recipe, Mapping):
        return None
    tag, _, value = label.partition(": ")
    if not value:
        return recipe
    given = recipe.get(tag)
    return recipe if (str(given) if given is not None else default_label) == value else None


def config_keys(
    model: type[BaseModel], recipe: Any = None, prefix: str = "", variant: str = ""
) -> list[Key]:
    """The keys of ``model``, nested sections flattened to dotted keys, with defaults from
    ``recipe`` (a plain mapping) where it sets them, else from the model. A section with
    variants lists the keys they share, then each one's own keys under its label."""
    out: list[Key] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        value = recipe.get(name) if isinstance(recipe, Mapping) else None
        nested = single_model(field.annotation)
        if nested is not None:
            out += _section_keys(nested, value, f"{key}.", variant)
            continue
        members = models_in(field.annotation)
        is_dict = typing.get_origin(unwrap(field.annotation)) is dict
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        if members and not is_dict and isinstance(default, BaseModel):
            pass  # a section of several forms: its default form (the recipe's keys follow)
        elif isinstance(recipe, Mapping) and name in recipe:
            default = REQUIRED if value == "???" else value
        elif field.is_required():
            default = REQUIRED
        out.append(Key(key, field.annotation, default, field_description(model, name), variant))
        if members and is_dict:
            for member in members:  # a mapping of named sections (e.g. env.<task>)
                out += config_keys(member, None, f"{key}.<name>.", variant)
            continue
        for member in members:  # one form of a union (e.g. data.train by its source)
            label = variant_label(member)
            chosen = _chosen(value, label, "") if label != member.__name__ else value
            out += config_keys(member, chosen, f"{key}.", label)
    return out


def _section_keys(model: type[BaseModel], recipe: Any, prefix: str, variant: str) -> list[Key]:
    variants = variants_of(model)
    if variants == [model]:
        return config_keys(model, recipe, prefix, variant)
    out = config_keys(model, recipe, prefix, variant)  # the keys every variant has
    shared = set(model.model_fields)
    for name in shared:  # the tag: its type is the variants' values (backend: 'hf' | 'vllm')
        tags = [unwrap(form.model_fields[name].annotation) for form in variants]
        if all(
            typing.get_origin(t) is typing.Literal and len(typing.get_args(t)) == 1 for t in tags
        ):
            values = tuple(typing.get_args(t)[0] for t in tags)
            out = [
                k._replace(annotation=typing.Literal[values]) if k.key == prefix + name else k
                for k in out
            ]
    default = str(model.model_fields["backend"].default) if "backend" in shared else ""
    for form in variants:
        label = variant_label(form)
        own = [k for k in config_keys(form, _chosen(recipe, label, default), prefix, label)]
        out += [k for k in own if k.key.removeprefix(prefix).split(".")[0] not in shared]
    return out


# -- commented YAML --------------------------------------------------------------------------


def _instance_descriptions(value: Any, path: tuple[str, ...], out: dict) -> None:
    """``{key path: description}`` of every field of ``value`` and of the sections in it, each
    described by the class it actually is (a backend's, a data source's)."""
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            out[(*path, name)] = field_description(type(value), name)
            _instance_descriptions(getattr(value, name), (*path, name), out)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _instance_descriptions(item, (*path, str(key)), out)


def commented_yaml(config: BaseModel, width: int = 100) -> str:
    """``config`` as YAML with each key's description as a comment above it: a recipe that
    documents itself (``rl <cmd> --print-config --commented``)."""
    import yaml

    descriptions: dict[tuple[str, ...], str] = {}
    _instance_descriptions(config, (), descriptions)
    out: list[str] = []

    def emit(mapping: Mapping, path: tuple[str, ...], indent: str) -> None:
        for key, value in mapping.items():
            description = descriptions.get((*path, str(key)), "")
            if description:
                out.extend(
                    textwrap.wrap(
                        description,
                        width,
                        initial_indent=f"{indent}# ",
                        subsequent_indent=f"{indent}# ",
                    )
                )
            if isinstance(value, Mapping) and value:
                out.append(indent + yaml.safe_dump({key: 0}).rsplit(":", 1)[0] + ":")
                emit(value, (*path, str(key)), indent + "  ")
            else:  # a value (a list included) dumped whole, so a long string keeps its form
                dumped = yaml.safe_dump({key: value}, sort_keys=False, width=width)
                out.extend(indent + line for line in dumped.splitlines())

    emit(config.model_dump(mode="json"), (), "")
    return "\n".join(out) + "\n"
