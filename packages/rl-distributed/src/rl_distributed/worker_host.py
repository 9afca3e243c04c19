"""The Ray actor that hosts one worker object, so the driver never imports the worker class.

The driver only names the class (``"pkg.module.Class"``); the class is imported here, inside
the worker's own process and Python environment. Every call goes through :meth:`execute`,
one Ray round trip like calling the method on a plain actor.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import socket
from dataclasses import dataclass
from typing import Any

import ray

from rl_distributed.hang_report import STACK_SIGNAL


def import_class(fqn: str) -> type:
    """Import ``"package.module.ClassName"``; errors name the path that failed."""
    module_name, _, class_name = fqn.rpartition(".")
    if not module_name:
        raise ValueError(f"worker class path {fqn!r} must look like 'package.module.ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"cannot import module {module_name!r} for worker {fqn!r}: {err}"
        ) from err
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no class {class_name!r}") from None


@dataclass(frozen=True)
class SharedArg:
    """An argument the driver stored once in the object store for all workers to fetch."""

    ref: ray.ObjectRef


class WorkerHost:
    """Builds the worker object from its class path and runs its methods on request."""

    def __init__(self, actor_class_fqn: str, args: tuple, kwargs: dict[str, Any]) -> None:
        # A segfault in native code then leaves a Python traceback in the worker's stderr log,
        # which the driver quotes when it reports the death.
        faulthandler.enable()
        # On SIGUSR1 every thread's stack goes to stderr too: how a hang report reads the stack
        # of a stuck worker where py-spy is not allowed to (see rl_distributed.hang_report).
        faulthandler.register(STACK_SIGNAL, all_threads=True, chain=False)
        self._fqn = actor_class_fqn
        self._worker = import_class(actor_class_fqn)(*args, **kwargs)

    def execute(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        try:
            bound = getattr(self._worker, method)
        except AttributeError:
            raise AttributeError(f"worker class {self._fqn!r} has no method {method!r}") from None
        kwargs = {
            k: ray.get(v.ref) if isinstance(v, SharedArg) else v for k, v in (kwargs or {}).items()
        }
        return bound(*args, **kwargs)

    def describe(self) -> dict[str, Any]:
        """Where this worker runs: enough for a human to find it when something goes wrong."""
        return {
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "placement_group_id": ray.get_runtime_context().get_placement_group_id(),
            "class": self._fqn,
            "stderr": _stderr_path(),
        }


def _stderr_path() -> str | None:
    """The file Ray sends this worker's stderr to (its ``worker-*.err`` log), if any."""
    try:
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    return path if os.path.isfile(path) else None
