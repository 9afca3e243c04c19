"""Small workers for tests, benchmarks and the cluster demo.

They live in the package (not in a test folder) because Ray workers import them by class path
in their own processes, which only see installed packages.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Any

_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR")


class EchoWorker:
    """Reports where it runs and misbehaves on request (to test failure handling)."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    def ping(self) -> None:
        return None

    def echo(self, **kwargs: Any) -> dict[str, Any]:
        return kwargs

    def env(self) -> dict[str, str]:
        env = {k: os.environ[k] for k in (*_DIST_ENV, "MASTER_PORT", "RL_WORKER_NAME")}
        return {**env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "")}

    def python(self) -> dict[str, str]:
        return {"executable": sys.executable, "version": sys.version.split()[0]}

    def package_version(self, name: str) -> str | None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(name)
        except PackageNotFoundError:
            return None

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def delayed_echo(self, seconds: float, **kwargs: Any) -> dict[str, Any]:
        time.sleep(seconds)
        return kwargs

    def die(self, how: str, stamp_file: str | None = None) -> None:
        """End this process the way real workers end: exit, SIGKILL (the OOM killer) or a
        segmentation fault in native code. ``stamp_file`` gets the time of death first."""
        if stamp_file:
            _stamp(stamp_file)
        if how == "exit":
            os._exit(3)
        elif how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segfault":
            ctypes.string_at(0)
        raise ValueError(f"unknown way to die: {how!r}")

    def die_or_block(self, victim_rank: int, how: str, stamp_file: str | None = None) -> None:
        """The victim dies; its peers block as if waiting for it in a collective."""
        if int(os.environ["RANK"]) == victim_rank:
            self.die(how, stamp_file)
        time.sleep(3600)

    def hang(self, how: str | None, stamp_file: str | None = None) -> None:
        """Stay alive but never answer: ``"stop"`` (SIGSTOP), ``"spin"`` (an endless busy
        loop) or ``"sleep"`` (blocked, as in a collective whose peer never comes); ``None``
        returns at once."""
        if how is None:
            return
        if stamp_file:
            _stamp(stamp_file)
        if how == "stop":
            _stopped_by_sigstop()
        elif how == "spin":
            _spinning_forever()
        elif how == "sleep":
            _sleeping_forever()
        raise ValueError(f"unknown way to hang: {how!r}")

    def cleanup(self) -> str:
        return self.tag

    def slow_cleanup(self) -> None:
        time.sleep(60)


def _stamp(path: str) -> None:
    with open(path, "w") as out:
        out.write(repr(time.time()))


def _stopped_by_sigstop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)  # if someone sends SIGCONT, stay hung


def _spinning_forever() -> None:
    n = 0
    while True:
        n += 1


def _sleeping_forever() -> None:
    while True:
        time.sleep(1)


class CountedPayload:
    """A result that counts how often the driver deserialises it (``CountedPayload.loads``)."""

    loads = 0

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self):
        return (_load_counted_payload, (self.value,))


def _load_counted_payload(value: Any) -> CountedPayload:
    CountedPayload.loads += 1
    return CountedPayload(value)


class DataParallelRegressor:
    """Linear regression trained data-parallel with torch.distributed (gloo) via DDP.

    Each rank takes its slice of the global batch; DDP all-reduces the gradients, so after
    every step all ranks hold the weights full-batch gradient descent would give.
    """

    def __init__(self, dim: int, lr: float, seed: int = 0) -> None:
        # torch is imported here, not at the top, so EchoWorker processes start without it.
        import torch
        import torch.distributed as dist

        dist.init_process_group(backend="gloo", init_method="env://")
        torch.manual_seed(seed)
        model = torch.nn.Linear(dim, 1, dtype=torch.float64)
        self.model = torch.nn.parallel.DistributedDataParallel(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

    def train_step(self, x, y) -> float:
        import torch

        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x).squeeze(-1), y)
        loss.backward()  # DDP averages gradients over ranks here.
        self.optimizer.step()
        return loss.item()

    def weights(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.model.module.state_dict().items()}

    def process_group(self) -> dict[str, int]:
        import torch.distributed as dist

        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
