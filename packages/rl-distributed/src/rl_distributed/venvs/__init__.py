"""Isolated, uv-built Python environments for worker groups (see ``registry`` and ``builder``).

Describing environments (the registry) needs nothing but the standard library; building and
placing them needs Ray. Those names are imported on first use, so a package that only
registers its environments imports where Ray is not installed (a GPU check, say).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from rl_distributed.venvs.registry import (
    SYSTEM,
    EnvRegistry,
    PythonEnv,
    UnknownEnvError,
    define_env,
    register_worker_env,
    registry,
)

_NEEDS_RAY = {
    "EnvBuildError": "builder",
    "cache_root": "builder",
    "clean_envs": "builder",
    "ensure_env": "builder",
    "list_envs": "builder",
    "rebuild_requested": "builder",
    "resolve": "builder",
    "python_per_node": "nodes",
}


def __getattr__(name: str) -> Any:
    if name in _NEEDS_RAY:
        return getattr(import_module(f"rl_distributed.venvs.{_NEEDS_RAY[name]}"), name)
    raise AttributeError(f"module 'rl_distributed.venvs' has no attribute {name!r}")


if TYPE_CHECKING:
    from rl_distributed.venvs.builder import (
        EnvBuildError,
        cache_root,
        clean_envs,
        ensure_env,
        list_envs,
        rebuild_requested,
        resolve,
    )
    from rl_distributed.venvs.nodes import python_per_node

__all__ = [
    "SYSTEM",
    "EnvBuildError",
    "EnvRegistry",
    "PythonEnv",
    "UnknownEnvError",
    "cache_root",
    "clean_envs",
    "define_env",
    "ensure_env",
    "list_envs",
    "python_per_node",
    "rebuild_requested",
    "register_worker_env",
    "registry",
    "resolve",
]
