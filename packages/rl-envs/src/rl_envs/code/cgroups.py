"""A cgroup of its own for each sandbox run, where the kernel offers one.

Resource limits (``setrlimit``) hold one process each, and the sandbox's memory watch sums the
resident memory of its processes: neither sees kernel memory, such as the buffers of sockets a
program fills and never reads (hundreds of MiB from one process). A cgroup does: the kernel
charges a run's kernel memory, socket buffers included, to its memory limit, counts all its
processes against one limit, and caps the CPU it gets, whatever it forks.

cgroup v2 is used when its hierarchy offers the ``memory`` and ``pids`` controllers, else the
v1 ``memory`` and ``pids`` hierarchies (as this project's CI machine has: there v2 offers only
``hugetlb``). Each run gets a child of an ``rl-sandbox`` group made beside this process's own
cgroup (v1) or at the v2 root. Making cgroups needs write access there: in practice, root.
Where none can be made, :func:`find_cgroups` says why, the sandbox says so once in its log and
in every result's ``isolation``, and refuses sockets instead (see :mod:`rl_envs.code.sandbox`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

GROUP = "rl-sandbox"
CPU_PERIOD_US = 100_000
_run_numbers = itertools.count()


@dataclass(frozen=True)
class CgroupSupport:
    version: int | None  # 2, 1, or None: no cgroup for runs
    parents: tuple[str, ...] = ()  # where runs' cgroups are made: one per v1 hierarchy
    why_not: str = ""

    @property
    def description(self) -> str:
        if self.version is None:
            return f"no cgroup ({self.why_not})"
        return f"cgroup v{self.version}: memory (kernel and socket memory too), processes, CPU"


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(filesystem type, mount point, root within the hierarchy, super options) of each
    cgroup mount, from /proc/self/mountinfo."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            fstype = fields[separator + 1]
            if fstype in ("cgroup", "cgroup2"):
                options = set(fields[separator + 3].split(","))
                mounts.append((fstype, fields[4], fields[3], options))
    return mounts


def _own_paths() -> dict[str, str]:
    """This process's cgroup per v1 controller, and under "" its v2 cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _write(path: str | Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _v2_parent() -> str:
    mount = next((point for fstype, point, _, _ in _mounts() if fstype == "cgroup2"), None)
    if mount is None:
        raise OSError("no cgroup v2 hierarchy is mounted")
    offered = Path(mount, "cgroup.controllers").read_text().split()
    missing = {"memory", "pids"} - set(offered)
    if missing:
        raise OSError(f"cgroup v2 at {mount} offers {offered}, not {sorted(missing)}")
    wanted = " ".join(f"+{c}" for c in ("memory", "pids", "cpu") if c in offered)
    parent = Path(mount, GROUP)
    parent.mkdir(exist_ok=True)
    # Controllers reach a child only when enabled in every ancestor's subtree_control.
    _write(Path(mount, "cgroup.subtree_control"), wanted)
    _write(parent / "cgroup.subtree_control", wanted)
    return str(parent)


def _v1_parents() -> tuple[str, ...]:
    own = _own_paths()
    parents = []
    for controller in ("memory", "pids", "cpu"):
        mount = next(
            ((m, root) for t, m, root, opts in _mounts() if t == "cgroup" and controller in opts),
            None,
        )
        if mount is None:
            if controller == "cpu":
                continue  # the CPU cap is a nicety; memory and processes are what must hold
            raise OSError(f"no cgroup v1 hierarchy has the {controller} controller")
        point, root = mount
        path = own.get(controller, "/")
        relative = path[len(root) :] if root != "/" and path.startswith(root) else path
        parent = Path(point + relative.rstrip("/"), GROUP)
        parent.mkdir(exist_ok=True)
        parents.append(str(parent))
    return tuple(parents)


@functools.cache
def find_cgroups() -> CgroupSupport:
    """Whether runs get cgroups here (found once per process), and if not, why not."""
    problems = []
    for version, find in ((2, lambda: (_v2_parent(),)), (1, _v1_parents)):
        try:
            support = CgroupSupport(version, find())
            RunCgroup(support, memory_bytes=64 << 20, max_processes=4, cpus=1.0).remove()
            return support
        except OSError as e:
            problems.append(f"v{version}: {e}")
    support = CgroupSupport(None, why_not="; ".join(problems))
    logger.warning(
        "sandbox runs get no cgroup here (%s): kernel memory such as socket buffers is not "
        "bounded, so the sandbox refuses sockets instead",
        support.why_not,
    )
    return support


class RunCgroup:
    """One run's cgroup (one per hierarchy on v1), made with its limits; :attr:`procs_files`
    are what a process writes "0" to, to join it."""

    def __init__(
        self, support: CgroupSupport, memory_bytes: int, max_processes: int, cpus: float
    ) -> None:
        self.version = support.version
        name = f"run-{os.getpid()}-{next(_run_numbers)}-{secrets.token_hex(4)}"
        self.dirs = [Path(parent, name) for parent in support.parents]
        try:
            for path in self.dirs:
                path.mkdir()
                self._limit(path, memory_bytes, max_processes, cpus)
        except OSError:
            self.remove()
            raise
        self.procs_files = [str(path / "cgroup.procs") for path in self.dirs]

    def _limit(self, path: Path, memory_bytes: int, max_processes: int, cpus: float) -> None:
        quota = f"{max(1000, int(cpus * CPU_PERIOD_US))}"
        if self.version == 2:
            settings = {
                "memory.max": str(memory_bytes),
                "memory.swap.max": "0",
                "memory.oom.group": "1",  # an out-of-memory kill takes the whole run
                "pids.max": str(max_processes),
                "cpu.max": f"{quota} {CPU_PERIOD_US}",
            }
        else:
            settings = {
                "memory.limit_in_bytes": str(memory_bytes),
                "memory.memsw.limit_in_bytes": str(memory_bytes),  # no swap (needs the above)
                # v1 charges TCP buffers apart from the rest, and only once this is set.
                "memory.kmem.tcp.limit_in_bytes": str(memory_bytes),
                "pids.max": str(max_processes),
                "cpu.cfs_period_us": str(CPU_PERIOD_US),
                "cpu.cfs_quota_us": quota,
            }
        if self.version == 2 and not (path / "memory.max").exists():
            raise OSError(f"{path}: the memory controller is not enabled there")
        for file, value in settings.items():
            target = path / file
            if target.exists():  # each v1 hierarchy has its own controller's files only
                _write(target, value)

    def memory_limited(self) -> bool:
        """Whether the run's memory reached its limit (the kernel then reclaims, refuses or
        kills)."""
        with contextlib.suppress(OSError, ValueError):
            for path in self.dirs:
                if self.version == 2:
                    events = dict(
                        line.split() for line in (path / "memory.events").read_text().splitlines()
                    )
                    return int(events.get("max", 0)) > 0 or int(events.get("oom_kill", 0)) > 0
                if (path / "memory.failcnt").exists():
                    return int((path / "memory.failcnt").read_text()) > 0
        return False

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (they exit asynchronously)."""
        for path in self.dirs:
            deadline = time.monotonic() + 5
            while path.exists():
                try:
                    path.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        logger.warning("could not remove the sandbox cgroup %s", path)
                        break
                    time.sleep(0.01)
