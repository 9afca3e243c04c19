"""Command-line parsing and writing resolved configs to disk."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel

from rl_distributed.config._errors import ConfigError
from rl_distributed.config._validation import resolve_config


def parse_cli(argv: Sequence[str]) -> tuple[Path | None, list[str]]:
    """Split ``argv`` into ``--config PATH`` (or ``--config=PATH``) and override strings."""
    config: Path | None = None
    overrides: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--config":
            value = next(args, "")
        elif arg.startswith("--config="):
            value = arg.removeprefix("--config=")
        elif arg.startswith("--"):
            raise ConfigError(
                f"Unknown option {arg!r}. Usage: --config PATH [overrides...], where an override "
                "is 'a.b=1' (change), '+a.b=1' (add), '++a.b=1' (add or change) or '~a.b' (delete)"
            )
        else:
            overrides.append(arg)
            continue
        if not value or value.startswith("--"):
            raise ConfigError("--config needs a path: --config PATH or --config=PATH")
        if config is not None:
            raise ConfigError(f"--config given twice: {str(config)!r} and {value!r}")
        config = Path(value)
    return config, overrides


def to_yaml(cfg: DictConfig | BaseModel | Mapping[str, Any]) -> str:
    """The config as YAML with every interpolation resolved (a model is dumped as JSON-like)."""
    if isinstance(cfg, BaseModel):
        data = cfg.model_dump(mode="json")
    else:
        data = resolve_config(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg)))
    return OmegaConf.to_yaml(data)


def save_config(
    cfg: DictConfig | BaseModel | Mapping[str, Any], path: str | os.PathLike[str]
) -> Path:
    """Write the resolved config to ``path`` (parents created, replaced atomically)."""
    path = Path(path)
    text = to_yaml(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
