"""Backends that a config section picks by name: ``generation.backend`` (``hf``, ``vllm``) and
``policy.backend`` (``dtensor``, ``megatron``).

A backend registers itself once (:meth:`BackendRegistry.register`) with its config class (the
section's keys under that backend), the class that runs it, and the Python environment its Ray
workers run in (the extra that installs its dependencies included). The section's config class
(``GenerationConfig``, ``PolicyConfig``) is then a union discriminated by ``backend`` whose
members are whatever is registered: validating ``{"backend": "hf", ...}`` into
``GenerationConfig`` gives an ``HfGenerationConfig``, and ``GenerationConfig(backend="hf")``
builds one too. A backend added later, one module that calls ``register``, goes through the
same validation, the same factory (``rl_algorithms.actors``), ``--help`` and docs.

Sections that extend a config with keys of their own (GRPO's ``generation.num_workers``, PPO's
``critic.colocated``) subclass the section's config class; validating into such a subclass
gives a class that is both the subclass and the backend's config (made once per pair).

Keys of another backend are refused with a message naming that backend (``generation.vllm.*
settings need generation.backend: vllm``), unless they hold that backend's defaults: a resolved
config written before the switch of backend still loads.
"""

from __future__ import annotations

import copy
import functools
import importlib
import types
import typing
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, model_validator
from pydantic_core import InitErrorDetails

from rl_distributed.config import ConfigModel
from rl_distributed.venvs import SYSTEM, PythonEnv, define_env, register_worker_env


def split_import_path(path: str, key: str | None = None) -> tuple[str, str]:
    """``(module, name)`` of an import path ``module:Name``, the one convention for classes a
    config or a backend names; a ValueError naming the config ``key`` when it is not one."""
    module, sep, name = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not (sep and module and name):
        where = f"{key}: " if key else ""
        raise ValueError(f"{where}{path!r} is not an import path 'module:Class'")
    return module, name


@dataclass(frozen=True)
class Backend:
    """One backend of a config section."""

    name: str
    #: Its config class: a subclass of the section's config with ``backend: Literal[name]``.
    config: type[BackendConfig]
    #: ``module:Class`` that runs it, imported only when the backend is chosen (its module may
    #: need the backend's dependencies): a generation backend's controller (a
    #: ``GenerationInterface``), a policy backend's worker class.
    implementation: str
    #: The Python environment its Ray workers run in: ``system`` (the driver's), the name of a
    #: defined one, or a ``PythonEnv`` spec (its ``extras`` are what to install).
    python_env: str | PythonEnv = SYSTEM
    #: The module (or class path) of its Ray worker classes, which run in ``python_env``.
    workers: str | None = None

    def __post_init__(self) -> None:
        split_import_path(self.implementation, f"backend {self.name!r}'s implementation")
        # The environment is where Ray starts the classes under `workers`; with none named,
        # nothing would run in it.
        if self.env_name != SYSTEM and self.workers is None:
            raise ValueError(
                f"backend {self.name!r}: python_env {self.env_name!r} needs workers (the "
                "module or class path of the Ray workers that run in it)"
            )

    @property
    def env_name(self) -> str:
        return self.python_env if isinstance(self.python_env, str) else self.python_env.name

    @property
    def implementation_class_path(self) -> str:
        """``implementation`` as the dotted class path a Ray worker builder imports."""
        return ".".join(split_import_path(self.implementation))


class BackendRegistry:
    """The backends of one config section, by name.

    ``key_prefix`` starts the keys named in errors (``"generation."``; empty where one config
    class serves several sections: ``policy``, ``critic``, ``teacher``). The built-in backends
    are registered by ``builtin_module``; backends installed by other packages are found through
    the ``entry_point_group`` entry points, each naming a module that registers its backend when
    imported. Both are imported at the first look-up.
    """

    def __init__(
        self, section: str, key_prefix: str, builtin_module: str, entry_point_group: str
    ) -> None:
        self.section = section
        self.key_prefix = key_prefix
        self.builtin_module = builtin_module
        self.entry_point_group = entry_point_group
        self._backends: dict[str, Backend] = {}
        self._plugins_loaded = False

    def register(self, backend: Backend) -> Backend:
        """Add (or replace) ``backend``; its workers are registered to its Python environment."""
        fixed = backend.config.model_fields["backend"].annotation
        if typing.get_args(fixed) != (backend.name,):
            raise ValueError(
                f"{backend.config.__name__}.backend must be Literal[{backend.name!r}] to be "
                f"registered as the {self.section} backend {backend.name!r}"
            )
        if isinstance(backend.python_env, PythonEnv):
            define_env(
                backend.python_env.name,
                extras=backend.python_env.extras,
                requirements=backend.python_env.requirements,
            )
        if backend.workers is not None:
            register_worker_env(backend.workers, backend.env_name)
        self._backends[backend.name] = backend
        return backend

    def unregister(self, name: str) -> None:
        self._backends.pop(name, None)

    def backends(self) -> list[Backend]:
        """Every registered backend (those of installed plugins included)."""
        self._load_plugins()
        return list(self._backends.values())

    def names(self) -> list[str]:
        return [backend.name for backend in self.backends()]

    def get(self, name: str) -> Backend:
        """The backend ``name``; a ValueError listing the known ones if there is none."""
        if name not in self._backends:
            self._load_plugins()
        try:
            return self._backends[name]
        except KeyError:
            known = ", ".join(repr(n) for n in self._backends)
            raise ValueError(
                f"{self.key_prefix}backend: no {self.section} backend {name!r}; known: {known}"
            ) from None

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        importlib.import_module(self.builtin_module)
        for entry in entry_points(group=self.entry_point_group):
            entry.load()  # the module registers its backend


class BackendConfig(ConfigModel):
    """A config section whose keys depend on its ``backend`` (see the module docstring).

    A family's base class sets ``registry`` and declares ``backend: str`` with the default
    backend; each backend's config subclasses it with ``backend: Literal[name]``.
    """

    # Fields typed with the base class hold a backend's config: dump all of its keys.
    model_config = ConfigDict(polymorphic_serialization=True)

    registry: ClassVar[BackendRegistry]
    # ``backend: str`` is declared by each family's base, where it belongs in the key order.

    def __new__(cls, *args: Any, **data: Any) -> Any:
        # GenerationConfig(backend="hf", ...) builds the hf backend's config; Python then runs
        # its __init__ (the object is an instance of cls).
        if not cls.is_backend_config():
            cls = cls.for_backend(data.get("backend", cls.default_backend()))
        return super().__new__(cls)

    @classmethod
    def is_backend_config(cls) -> bool:
        """Whether this class is one backend's (``backend`` a one-value Literal)."""
        return typing.get_origin(cls.model_fields["backend"].annotation) is Literal

    @classmethod
    def default_backend(cls) -> str:
        return cls.model_fields["backend"].default

    @classmethod
    def for_backend(cls, name: str) -> type[BackendConfig]:
        """This class under backend ``name``: the backend's config class, or a class that is
        both this subclass (with its own keys) and the backend's config."""
        config = cls.registry.get(name).config
        return config if issubclass(config, cls) else _combined(cls, config)

    @classmethod
    def config_variants(cls) -> list[type[BaseModel]]:
        """The classes a value of this section can be: one per registered backend."""
        if cls.is_backend_config():
            return [cls]
        return [cls.for_backend(name) for name in cls.registry.names()]

    @model_validator(mode="wrap")
    @classmethod
    def _as_its_backend(cls, data: Any, handler: Any) -> Any:
        if cls.is_backend_config():
            if isinstance(data, dict):
                data = _without_other_backends_defaults(cls, data)
            return handler(data)
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            return handler(data)  # pydantic's own error: not a mapping
        name = data.get("backend", cls.default_backend())
        try:
            target = cls.for_backend(name)
        except ValueError:
            raise _unknown_backend(cls, name) from None
        return target.model_validate(data)


#: ``generation.backend``: ``rl_models.generation.config`` registers hf and vllm.
GENERATION_BACKENDS = BackendRegistry(
    "generation", "generation.", "rl_models.generation.config", "rl_models.generation_backends"
)
#: ``policy.backend`` (and ``critic.backend``, ``teacher.backend``): ``rl_models.policy.config``
#: registers dtensor and megatron.
POLICY_BACKENDS = BackendRegistry(
    "policy", "", "rl_models.policy.config", "rl_models.policy_backends"
)


def _unknown_backend(cls: type[BackendConfig], name: Any) -> ValidationError:
    known = ", ".join(repr(n) for n in cls.registry.names())
    detail = InitErrorDetails(
        type="literal_error", loc=("backend",), input=name, ctx={"expected": known}
    )
    return ValidationError.from_exception_data(cls.__name__, [detail])


def _without_other_backends_defaults(cls: type[BackendConfig], data: dict) -> dict:
    """``data`` less keys of other backends that hold those backends' defaults; a key of
    another backend set to anything else is an error naming that backend."""
    registry = cls.registry
    out = dict(data)
    for key in data.keys() - cls.model_fields.keys():
        for other in registry.backends():
            if key not in vars(other.config).get("__annotations__", {}):
                continue  # not a key this backend adds
            field = other.config.model_fields[key]
            if _is_default(field, data[key]):
                del out[key]
                break
            prefix, backend = registry.key_prefix, f"{registry.key_prefix}backend: {other.name}"
            if _is_section(field.annotation):
                raise ValueError(f"{prefix}{key}.* settings need {backend}")
            raise ValueError(f"{prefix}{key} applies to {backend}")
    return out


def _is_default(field: Any, value: Any) -> bool:
    try:
        validated = TypeAdapter(field.annotation).validate_python(value)
    except ValidationError:
        return False
    return validated == field.get_default(call_default_factory=True)


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


@functools.cache
def _combined(extension: type[BackendConfig], config: type[BackendConfig]) -> type:
    """A class that is ``extension`` (a section's subclass with keys of its own) under the
    backend of ``config``. The backend's own keys come from ``config``; the rest, redeclared
    ones included, from ``extension``."""
    own = vars(config).get("__annotations__", {})
    namespace = {
        "__module__": extension.__module__,
        "__qualname__": f"{extension.__qualname__}[{config.model_fields['backend'].default}]",
        "__annotations__": {name: config.model_fields[name].annotation for name in own},
        **{name: copy.copy(config.model_fields[name]) for name in own},
        "__reduce__": _reduce_combined,
    }
    return types.new_class(
        namespace["__qualname__"],
        (extension, config),
        exec_body=lambda ns: ns.update(namespace),
    )


def _reduce_combined(self: BackendConfig) -> tuple:
    # Made at run time, such a class cannot be found by name: pickle the pair it came from.
    extension, config = type(self).__bases__
    return _restore, (extension, config, self.__getstate__())


def _restore(extension: type, config: type, state: dict) -> BackendConfig:
    cls = _combined(extension, config)
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj
