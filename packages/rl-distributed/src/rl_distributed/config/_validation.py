"""Resolving interpolations and validating into pydantic models, with readable errors."""

from __future__ import annotations

import enum
import re
import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue
from pydantic import BaseModel, ConfigDict, ValidationError

from rl_distributed.config._errors import ConfigError, ConfigIssue, did_you_mean
from rl_distributed.config._loading import drop_override_markers

T = TypeVar("T", bound=BaseModel)


class ConfigModel(BaseModel):
    """Base class for every typed config: unknown keys are errors, defaults and assignments are
    validated, and field names may start with ``model_``."""

    model_config = ConfigDict(
        extra="forbid",
        validate_default=True,
        validate_assignment=True,
        frozen=False,
        protected_namespaces=(),
    )


def validate_config(cfg: DictConfig | Mapping[str, Any], model: type[T]) -> T:
    """Resolve every interpolation in ``cfg`` and validate the result into ``model``.

    Raises :class:`ConfigError` listing every problem, one per line, as
    ``<dotted.key>: got <value> — expected <what>``.
    """
    data = resolve_config(cfg) if isinstance(cfg, DictConfig) else cfg
    try:
        return model.model_validate(data)
    except ValidationError as e:
        issues: dict[str, ConfigIssue] = {}
        for err in e.errors():
            # A validator that checked a section against a config of its own (an environment's
            # config) raises a ConfigError: its issues name their own keys.
            nested = err.get("ctx", {}).get("error")
            found = nested.errors if isinstance(nested, ConfigError) and nested.errors else []
            for issue in found or [_issue(model, err)]:
                issues.setdefault(issue.key, issue)  # a union reports once per member; keep one
        n = len(issues)
        lines = "\n".join(f"  {issue}" for issue in issues.values())
        raise ConfigError(
            f"Invalid config for {model.__name__} ({n} problem{'s' * (n != 1)}):\n{lines}",
            list(issues.values()),
        ) from None


def resolve_config(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` as plain dicts and lists with every ``${...}`` resolved, without the
    ``_override_`` markers of its files.

    Raises :class:`ConfigError` naming the key whose interpolation failed, or the first key
    still set to ``???``.
    """
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        assert isinstance(data, dict)
        drop_override_markers(data)  # they told the merge what to do; no config has them
        return data
    except InterpolationResolutionError as e:
        key = _dotted(e.full_key)
        reason = str(e).splitlines()[0]
        issue = ConfigIssue(key, "interpolation", reason, _raw_at(cfg, key))
        raise ConfigError(f"Cannot resolve config: {issue}", [issue]) from None
    except MissingMandatoryValue as e:
        key = _dotted(e.full_key)
        issue = ConfigIssue(key, "mandatory", f"required value never set (pass '{key}=...')")
        raise ConfigError(f"Incomplete config: {issue}", [issue]) from None


def _dotted(full_key: Any) -> str:
    return ".".join(re.findall(r"[^.\[\]]+", str(full_key)))  # 'a.l[1]' -> 'a.l.1'


def _raw_at(cfg: DictConfig, key: str) -> Any:
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    try:
        for part in key.split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
    except (KeyError, IndexError, ValueError, TypeError):
        return None
    return node


def _issue(model: type[BaseModel], err: Any) -> ConfigIssue:
    loc, kind, value = err["loc"], err["type"], err.get("input")
    path, ann = _walk(model, loc)
    key = ".".join(str(p) for p in path) or "<root>"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        parent = _walk(model, loc[:-1])[1]
        names = list(dict.fromkeys(n for m in _variants(parent) for n in m.model_fields))
        hint = did_you_mean(str(loc[-1]), names) or (
            f"allowed keys: {', '.join(names)}" if names else ""
        )
        expected = f"unknown key; {hint}" if hint else "unknown key"
    elif len(_members(ann)) > 1:  # stopped at a union of plain types
        expected = type_name(ann)
    elif kind in ("literal_error", "enum"):
        choices = _choices(ann)
        if choices is not None:
            expected = "one of " + ", ".join(repr(c) for c in choices)
        else:
            expected = "one of " + err.get("ctx", {}).get("expected", msg)
    elif ann is None or msg.startswith("expected "):  # a validator that says what it wants
        expected = msg.removeprefix("expected ")
    elif kind == "missing" or kind.endswith(("_type", "_parsing")) or kind == "int_from_float":
        expected = type_name(ann)
    elif msg.startswith("Input should be "):  # constraints: 'greater than 0', ...
        expected = f"{type_name(ann)}, {msg.removeprefix('Input should be ')}"
    else:
        expected = f"{type_name(ann)} ({msg})"
    return ConfigIssue(key, kind, expected, None if kind == "missing" else value)


def _walk(model: type[BaseModel], loc: Sequence[str | int]) -> tuple[list[str | int], Any]:
    """Map pydantic's error location to the user's key path and the annotation found there.

    Pydantic puts a union member's tag (class name, discriminator value or type name) into the
    location; those are dropped from the path. Returns annotation ``None`` where unknown.
    """
    path: list[str | int] = []
    ann: Any = model
    for part in loc:
        members = _members(ann)
        if len(members) > 1:
            picked = next((m for m in members if _is_tag_for(m, part)), None)
            if picked is None:  # a plain-type member: report at the union itself
                return path, ann
            ann = picked
            continue
        path.append(part)
        ann = _child(members[0] if members else None, part)
    return path, ann


def _members(ann: Any) -> list[Any]:
    """Non-None alternatives of an annotation (``[int]`` for ``int | None``)."""
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    if get_origin(ann) in (Union, types.UnionType):
        return [m for alt in get_args(ann) for m in _members(alt) if m is not type(None)]
    return [] if ann is None else [ann]


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _is_tag_for(member: Any, tag: str | int) -> bool:
    if not _is_model(member):
        return False
    if member.__name__ == tag:
        return True
    literals = (f.annotation for f in member.model_fields.values())
    return any(get_origin(a) is Literal and tag in get_args(a) for a in literals)


def _variants(ann: Any) -> list[type[BaseModel]]:
    """A model and the forms a section of its type can take (``config_variants``: one per
    backend of a section chosen by ``backend``)."""
    if not _is_model(ann):
        return []
    variants = getattr(ann, "config_variants", None)
    return [ann, *(variants() if variants is not None else [])]


def _child(ann: Any, part: str | int) -> Any:
    if _is_model(ann):
        if not isinstance(part, str):
            return None
        fields = (m.model_fields.get(part) for m in _variants(ann))
        field = next((f for f in fields if f is not None), None)
        return field.annotation if field else None
    origin, args = get_origin(ann), get_args(ann)
    if origin in (dict, Mapping) and len(args) == 2:
        return args[1]
    if origin is tuple and args and isinstance(part, int):
        return args[0] if args[-1] is Ellipsis else (args[part] if part < len(args) else None)
    if origin in (list, set, frozenset, Sequence) and args:
        return args[0]
    return None


def _choices(ann: Any) -> list[Any] | None:
    """Allowed values for Literal / Enum annotations (``None`` included when optional)."""
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    if ann is type(None):
        return [None]
    if get_origin(ann) is Literal:
        return list(get_args(ann))
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return [m.value for m in ann]
    if get_origin(ann) in (Union, types.UnionType):
        parts = [_choices(alt) for alt in get_args(ann)]
        if all(p is not None for p in parts):
            return [c for p in parts for c in p]  # type: ignore[union-attr]
    return None


def type_name(ann: Any) -> str:
    """An annotation as a user reads it: ``int | None``, ``list[str]``, ``ChatFileConfig |
    ArithmeticConfig`` (no module paths, no ``Annotated`` metadata such as a discriminator)."""
    origin, args = get_origin(ann), get_args(ann)
    if ann is type(None):
        return "None"
    if origin is Annotated:
        return type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if isinstance(ann, type) and not args:
        return ann.__name__
    if origin is not None and args:
        return f"{type_name(origin)}[{', '.join(type_name(a) for a in args)}]"
    text = repr(ann).replace("typing.", "")
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", text)  # drop module paths
