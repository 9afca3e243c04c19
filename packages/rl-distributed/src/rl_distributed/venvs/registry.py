"""Which Python environment each worker class runs in.

An environment is ``system`` (the driver's own Python), a set of workspace extras from the root
pyproject (``vllm``, ``mcore``: resolved from the one ``uv.lock``), or a user-defined list of
requirements. Worker classes are registered by class path or by module prefix; the longest
match wins, so ``rl_models.generation.vllm`` covers every class in that module tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SYSTEM = "system"
#: What unregistered worker classes get: "system" (default) or "error".
UNREGISTERED_ENV_VAR = "RL_UNREGISTERED_WORKER_ENV"


class UnknownEnvError(KeyError):
    """A worker or environment name that the registry does not know."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


@dataclass(frozen=True)
class PythonEnv:
    """A named Python environment that worker groups can run in."""

    name: str
    extras: tuple[str, ...] = ()  # workspace extras (uv sync --extra ...)
    requirements: tuple[str, ...] = ()  # further requirements (uv pip install ...)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"environment name {self.name!r} must be a plain, non-empty name")
        if self.name == SYSTEM and (self.extras or self.requirements):
            raise ValueError("the 'system' environment is the driver's Python; it takes no spec")

    @property
    def is_system(self) -> bool:
        return self.name == SYSTEM


class EnvRegistry:
    """Named environments, and which worker classes run in which."""

    def __init__(self) -> None:
        self._envs: dict[str, PythonEnv] = {}
        self._workers: dict[str, str] = {}
        for env in (
            PythonEnv(SYSTEM),
            PythonEnv("vllm", ("vllm",)),
            PythonEnv("mcore", ("mcore",)),
        ):
            self.define(env)

    def define(self, env: PythonEnv) -> PythonEnv:
        """Add (or replace) an environment definition."""
        self._envs[env.name] = env
        return env

    def get(self, name: str) -> PythonEnv:
        try:
            return self._envs[name]
        except KeyError:
            raise UnknownEnvError(
                f"no Python environment named {name!r}; defined: {sorted(self._envs)}"
            ) from None

    @property
    def envs(self) -> dict[str, PythonEnv]:
        return dict(self._envs)

    def register(self, worker: str, env: str) -> None:
        """Run ``worker`` (a class path, or a module prefix covering many) in ``env``."""
        self.get(env)
        self._workers[worker] = env

    def env_for(self, actor_class_fqn: str) -> PythonEnv:
        """The environment for a worker class: exact path, else the longest module prefix."""
        parts = actor_class_fqn.split(".")
        for cut in range(len(parts), 0, -1):
            name = self._workers.get(".".join(parts[:cut]))
            if name is not None:
                return self.get(name)
        if os.environ.get(UNREGISTERED_ENV_VAR, SYSTEM) == "error":
            raise UnknownEnvError(
                f"worker class {actor_class_fqn!r} is not registered to a Python environment "
                f"(register_worker_env), and {UNREGISTERED_ENV_VAR}=error"
            )
        return self.get(os.environ.get(UNREGISTERED_ENV_VAR, SYSTEM))


#: The process-wide registry that worker groups consult.
registry = EnvRegistry()


def define_env(
    name: str,
    *,
    extras: tuple[str, ...] | list[str] = (),
    requirements: tuple[str, ...] | list[str] = (),
) -> PythonEnv:
    """Define a named environment, e.g. ``define_env("judge", requirements=["sympy==1.13"])``."""
    return registry.define(PythonEnv(name, tuple(extras), tuple(requirements)))


def register_worker_env(worker: str, env: str) -> None:
    """Run the worker class (or every class under the module prefix) ``worker`` in ``env``."""
    registry.register(worker, env)
