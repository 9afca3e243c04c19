"""Hydra-grammar overrides (``a.b=1``, ``+a=1``, ``++a=1``, ``~a``) applied to a DictConfig."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rl_distributed.config._errors import ConfigError, did_you_mean


@cache
def _parser() -> OverridesParser:
    return OverridesParser.create()


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Return a copy of ``cfg`` with Hydra-grammar overrides applied in order."""
    cfg = copy.deepcopy(cfg)
    for text in overrides:
        _apply_override(cfg, text)
    return cfg


def _apply_override(cfg: DictConfig, text: str) -> None:
    def fail(msg: str) -> ConfigError:
        return ConfigError(f"Override {text!r}: {msg}")

    try:
        [ov] = _parser().parse_overrides([text])
    except OverrideParseException as e:
        hint = ""
        if text.count("${") > 1:  # Hydra's grammar only takes flat ${...} unquoted
            key, _, value = text.partition("=")
            hint = f"\nNested interpolations must be quoted: {key}='{value}'"
        raise ConfigError(f"Cannot parse override {text!r}: {e}{hint}") from None
    if ov.package is not None:
        raise fail("'@package' is not supported; write the full dotted key")
    if ov.is_sweep_override():
        raise fail("sweeps are not supported; for a list write a=[1,2], for a string quote it")
    key = ov.key_or_group
    parent, last, exists = _locate(cfg, key, fail)
    value = ov.value()

    def close() -> str:
        hint = did_you_mean(key, _all_keys(cfg))
        return f" ({hint})" if hint else ""

    if ov.is_delete():
        if not exists:
            raise fail(f"key '{key}' is not in the config{close()}; nothing to delete")
        if ov.value_type is not None and not _value_matches(parent, last, value):
            current = _raw(parent, last)
            raise fail(f"'{key}' is {current!r}, not {value!r}; use '~{key}' to delete it anyway")
        del parent[last]
        return
    if ov.is_add() and exists:
        raise fail(
            f"key '{key}' already exists (= {_raw(parent, last)!r}); "
            f"use '{text[1:]}' to change it, or '+{text}' to add-or-change"
        )
    if not (ov.is_add() or ov.is_force_add() or exists):
        # A near miss is most likely a typo: adding it with '+' would only be refused next.
        hint = close()
        how = "" if hint else f"; to add a new key use '+{text}'"
        raise fail(f"key '{key}' is not in the config{hint}{how}")
    try:
        OmegaConf.update(cfg, key, value, merge=True, force_add=True)
    except OmegaConfBaseException as e:
        raise fail(str(e).splitlines()[0]) from None


def _locate(cfg: DictConfig, key: str, fail: Callable[[str], ConfigError]) -> tuple[Any, Any, bool]:
    """Find ``key``'s parent container without resolving the leaf: (parent, last, exists)."""
    *path, last = key.split(".")
    node: Any = cfg
    for i, part in enumerate(path):
        if not has_key(node, part) or OmegaConf.is_missing(node, _index(node, part)):
            return None, last, False
        if OmegaConf.is_interpolation(node, _index(node, part)):
            where = ".".join(path[: i + 1])
            raise fail(f"'{where}' is an interpolation; override '{where}' or what it points to")
        node = node[_index(node, part)]
    if not isinstance(node, DictConfig | ListConfig) or not has_key(node, last):
        return node if isinstance(node, DictConfig | ListConfig) else None, last, False
    return node, _index(node, last), True


def has_key(node: Any, part: str) -> bool:
    """Whether ``part`` is a key (or list index) of ``node``, counting keys set to ``???``."""
    if isinstance(node, DictConfig):
        return part in node.keys()  # noqa: SIM118 -- `in node` says False for '???' values
    if isinstance(node, ListConfig):
        return part.isdigit() and int(part) < len(node)
    return False


def _index(node: Any, part: str) -> str | int:
    return int(part) if isinstance(node, ListConfig) else part


def _raw(parent: Any, last: str | int) -> Any:
    return OmegaConf.to_container(parent, resolve=False)[last]


def _value_matches(parent: Any, last: str | int, value: Any) -> bool:
    if _raw(parent, last) == value:
        return True
    try:  # ~a=3 also deletes `a: ${b}` when b is 3
        resolved = parent[last]
    except OmegaConfBaseException:
        return False
    if isinstance(resolved, DictConfig | ListConfig):
        resolved = OmegaConf.to_container(resolved, resolve=True)
    return resolved == value


def _all_keys(cfg: DictConfig) -> list[str]:
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            keys.append(f"{prefix}{k}")
            if isinstance(v, dict | list):
                walk(v, f"{prefix}{k}.")

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return keys
