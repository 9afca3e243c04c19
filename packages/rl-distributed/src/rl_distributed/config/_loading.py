"""Reading YAML files and merging their ``defaults:`` parents."""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rl_distributed.config._errors import ConfigError
from rl_distributed.config._overrides import apply_overrides, has_key

_DEFAULTS_KEY = "defaults"
#: ``_override_: true`` in a mapping of a config file: that mapping takes the place of the one it
#: would be merged into (a parent's, or the default recipe's) instead of merging key by key, so
#: that a child can give a section of another form (another kind of data source, say).
OVERRIDE_KEY = "_override_"


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> DictConfig:
    """Load a YAML config with its ``defaults:`` parents, then apply Hydra-style overrides.

    Interpolations are left unresolved; see :func:`validate_config`.
    """
    root = Path(path).expanduser().resolve()
    if not root.is_file():
        raise ConfigError(f"Config file not found: {path}")
    return apply_overrides(_load_tree(root, ()), overrides)


def _load_tree(path: Path, chain: tuple[Path, ...]) -> DictConfig:
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"Cycle in `defaults`: {cycle}")
    cfg = _read_yaml(path)
    _check_override_markers(OmegaConf.to_container(cfg, resolve=False), path)
    parents = [_load_tree(p, (*chain, path)) for p in _pop_defaults(cfg, path)]
    if not parents:
        return cfg
    return merge_layers(*parents, cfg)


def merge_layers(*layers: DictConfig) -> DictConfig:
    """``layers`` merged in order, later ones winning, as ``OmegaConf.merge`` does, except that
    a mapping of a later layer marked ``_override_: true`` replaces the earlier layers' mapping
    at its key instead of merging into it.

    The markers stay in the result, so that a file's replacement also holds against what it
    is merged onto later (the default recipe under a ``--config`` file); ``resolve_config``
    (and so ``validate_config``) drops them."""
    merged = layers[0]
    for layer in layers[1:]:
        base = copy.deepcopy(merged)
        for keys in _replacing(OmegaConf.to_container(layer, resolve=False)):
            _delete(base, keys)
        merged = OmegaConf.merge(base, layer)
    assert isinstance(merged, DictConfig)
    return merged


def drop_override_markers(tree: object) -> None:
    """Remove every ``_override_`` key from plain dicts and lists, in place."""
    if isinstance(tree, dict):
        tree.pop(OVERRIDE_KEY, None)
        children: Iterator[object] = iter(tree.values())
    elif isinstance(tree, list):
        children = iter(tree)
    else:
        return
    for child in children:
        drop_override_markers(child)


def _replacing(tree: object, keys: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The key paths of the mappings in ``tree`` marked ``_override_: true``."""
    if not isinstance(tree, dict):
        return
    if tree.get(OVERRIDE_KEY) is True:
        yield keys
        return  # what is below it replaces too: the whole mapping does
    for key, value in tree.items():
        yield from _replacing(value, (*keys, str(key)))


def _delete(cfg: DictConfig, keys: tuple[str, ...]) -> None:
    """Delete the value at ``keys`` from ``cfg``, if there is one."""
    node: object = cfg
    for key in keys[:-1]:
        if (
            not isinstance(node, DictConfig)
            or key not in node
            or OmegaConf.is_interpolation(node, key)
        ):
            return
        node = node[key]
    if keys and isinstance(node, DictConfig) and keys[-1] in node:
        del node[keys[-1]]


def _check_override_markers(tree: object, path: Path, keys: tuple[str, ...] = ()) -> None:
    if isinstance(tree, list):
        for i, item in enumerate(tree):
            _check_override_markers(item, path, (*keys, str(i)))
    if not isinstance(tree, dict):
        return
    marker = tree.get(OVERRIDE_KEY)
    if OVERRIDE_KEY in tree and not isinstance(marker, bool):
        where = ".".join((*keys, OVERRIDE_KEY))
        raise ConfigError(
            f"{path}: key '{where}' must be true (this mapping replaces its parent's) or false "
            f"(it merges into it), got {marker!r}"
        )
    for key, value in tree.items():
        _check_override_markers(value, path, (*keys, str(key)))


def _read_yaml(path: Path) -> DictConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"Cannot read config file {path}: {e.strerror or e}") from None
    try:
        cfg = OmegaConf.load(io.StringIO(text))  # OmegaConf's YAML dialect (e.g. 1e-3 is a float)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        lines = text.splitlines()
        snippet = ""
        if mark and mark.line < len(lines):
            snippet = f"\n    {lines[mark.line]}\n    {' ' * mark.column}^"
        problem = " ".join(filter(None, [e.context, e.problem]))
        raise ConfigError(f"Invalid YAML in {path}{where}: {problem}{snippet}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"Invalid YAML in {path}: {e}") from None
    except OSError:  # OmegaConf's way of saying "the document is a scalar"
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values") from None
    except OmegaConfBaseException as e:  # e.g. a malformed ${...}
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{path}: key '{e.full_key}': {msg}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, not a list")
    return cfg


def _pop_defaults(cfg: DictConfig, path: Path) -> list[Path]:
    if not has_key(cfg, _DEFAULTS_KEY):
        return []
    raw = OmegaConf.to_container(cfg, resolve=False)[_DEFAULTS_KEY]
    del cfg[_DEFAULTS_KEY]
    entries = [raw] if isinstance(raw, str) else raw
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise ConfigError(
            f"{path}: `defaults` must be a file path or a list of file paths, got {raw!r}"
        )
    return [_find_parent(entry, path) for entry in entries]


def _find_parent(entry: str, referrer: Path) -> Path:
    if entry == "_self_":
        raise ConfigError(
            f"{referrer}: '_self_' in `defaults` is not supported; "
            "a file's own keys always override its defaults"
        )
    candidate = (referrer.parent / Path(entry).expanduser()).resolve()  # absolute stays absolute
    tries = [candidate]
    packaged = _packaged_file(entry)
    if packaged is not None:
        tries.insert(0, packaged)
    for p in list(tries):
        if p.suffix not in (".yaml", ".yml"):
            tries.append(p.with_name(p.name + ".yaml"))
    for p in tries:
        if p.is_file():
            return p
    raise ConfigError(
        f"Parent config not found: {tries[0]} (from `defaults: {entry}` in {referrer})"
    )


def _packaged_file(entry: str) -> Path | None:
    """``package:path/in/it.yaml``: a file installed with a Python package (a recipe that
    ships with a library, such as ``rl_algorithms:recipes/grpo_main.yaml``), wherever the
    package is installed. None when ``entry`` has no such form or names no package."""
    import importlib.util
    import re

    match = re.fullmatch(r"([A-Za-z_][\w.]*):([^:]+)", entry)
    if match is None:
        return None
    try:
        spec = importlib.util.find_spec(match.group(1))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / match.group(2)
