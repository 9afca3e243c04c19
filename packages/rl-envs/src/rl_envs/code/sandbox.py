"""Run a model-written program on test inputs in a sandbox; compare its outputs outside it.

The program only *produces outputs*: a launcher inside the sandbox (:mod:`rl_envs.code._launcher`)
runs it on each case's inputs and writes back what it printed or returned. This process, which
the program cannot reach, compares those outputs with the expected ones
(:func:`rl_envs.code.cases.case_passed`), which never enter the sandbox.

Isolation is bubblewrap (``bwrap``, Debian package ``bubblewrap``), which needs no root: it
uses unprivileged user namespaces. Each run gets

* its own user, PID, network, mount, IPC, UTS and cgroup namespaces; no capabilities, no
  nested user namespaces, a new terminal session;
* a filesystem of read-only system directories (``/usr``, ``/lib``...) and the interpreter,
  a fresh ``/proc``, a minimal ``/dev``, and size-limited ``tmpfs`` at ``/tmp`` (its working
  directory) and ``/dev/shm``; nothing of the host is writable, no home, no project files;
* an empty network namespace: not even the host's loopback (Ray's ports) is reachable;
* a cleared environment; resource limits on memory, CPU, processes, file size, open files;
* a watch on the resident memory of all its processes together (``RLIMIT_AS`` holds one
  process only, and a program may fork up to ``max_processes`` of them): over ``memory_mb``,
  the whole sandbox is killed;
* a cgroup of its own where the kernel offers one (:mod:`rl_envs.code.cgroups`): ``memory_mb``
  then bounds all its memory, kernel memory and socket buffers included, ``max_processes``
  all its processes, ``cpus`` the CPU time it gets per second. Where none can be made (not
  root, no memory controller), every result's ``isolation`` says "no cgroup" and why, and the
  seccomp filter also refuses ``socket`` and ``socketpair``: their kernel buffers would be
  memory nothing watches (pipe buffers remain, bounded by the kernel's per-user pipe limits);
* a seccomp filter refusing the two ways to hold memory that no process's resident set shows
  (and ``RLIMIT_AS`` does not bound): System V shared memory (``shmget``; a segment lives on,
  detached, until its IPC namespace ends) and ``memfd_create``; the kernel keyring calls
  (``add_key``, ``request_key``, ``keyctl``): keyrings have no namespace, so a program could
  leave keys that outlive its run, use up its uid's key quota for every later run, read keys
  of the verifier's uid, and pass data to concurrent and later runs; and every system call of
  a foreign ABI (32-bit, x32), whose numbers the filter does not know;
* a whole-sandbox kill: SIGKILL to the PID namespace's init takes every process of the run
  with it, however it forked or daemonised. Nothing is ever killed by uid.

When the caller is root, ``bwrap`` itself is started as ``nobody`` (the uid that by convention
owns nothing), so the program holds no root credentials even outside its namespace and the
process limit is enforced (the kernel exempts root from it).

Where bubblewrap is missing or user namespaces are disabled, running a program raises
:class:`SandboxUnavailableError` unless ``allow_unisolated: true``; then it runs as a plain
child process (its own session, resource limits, a temporary directory, a cleared environment,
but the caller's uid, network and files) and every result says ``isolated=False``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import pwd
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_distributed.config import ConfigModel
from rl_envs.code.cases import ReportShape, StdioCase, TestCase, case_passed, sandbox_job
from rl_envs.code.cgroups import CgroupSupport, RunCgroup, find_cgroups

logger = logging.getLogger(__name__)

LAUNCHER = (Path(__file__).parent / "_launcher.py").read_text()
#: System directories the program may read (those that exist), read-only.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache")
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
STDERR_KEPT_BYTES = 16384
MEMORY_CHECK_S = 0.1  # how often the sandbox's total resident memory is summed
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# Per machine: the seccomp audit arch, the system calls the sandbox always refuses (shmget,
# memfd_create, add_key, request_key, keyctl), and those it refuses without a cgroup (socket,
# socketpair).
SECCOMP_ABI = {
    "x86_64": (0xC000003E, (29, 319, 248, 249, 250), (41, 53)),
    "aarch64": (0xC00000B7, (194, 279, 217, 218, 219), (198, 199)),
}.get(platform.machine())
# Time a case's report may take beyond ``case_time_s`` to reach this process (starting an
# interpreter for the case, writing the report), before the case counts as over its limit.
CASE_TIME_SLACK_S = 1.0


class SandboxUnavailableError(RuntimeError):
    """No isolation on this machine, and running unisolated was not allowed."""


class SandboxLimits(ConfigModel):
    """What one program may use, and whether it may run without isolation."""

    cpu_time_s: int = 5  # CPU seconds per process (function-call cases share one process)
    case_time_s: float = 5.0  # wall seconds per test case
    wall_time_s: float = 20.0  # wall seconds for the whole run, all cases
    memory_mb: int = 1024  # address space per process, and all memory of all together
    max_processes: int = 16  # processes and threads in the sandbox
    cpus: float = 1.0  # CPU time per second of all its processes together (with a cgroup)
    # Largest file the program may write.
    max_file_size_mb: int = 16
    tmp_size_mb: int = 64  # the private /tmp (working directory) and /dev/shm, each
    max_output_bytes: int = 1 << 20  # stdout per case; more fails the case
    # Without bubblewrap the program would run as this process's uid, with its network and
    # files: only with this set, and then every result says so.
    allow_unisolated: bool = False
    python: str | None = None  # the program's interpreter; default: ours, else python3


@dataclass
class SandboxResult:
    passed: list[bool]
    outputs: list[dict[str, Any] | None]  # per case: what the program printed or returned
    timed_out: bool  # the whole run hit ``wall_time_s``
    stderr: str
    isolated: bool
    isolation: str  # how it ran, in words
    output_limited: bool = False  # its output ran over the limit and was cut
    memory_limited: bool = False  # its processes together held more than ``memory_mb``

    @property
    def reward(self) -> float:
        """Fraction of cases passed (0 when there are none)."""
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


NO_CGROUP = CgroupSupport(None, why_not="not isolated")


@dataclass(frozen=True)
class Isolation:
    bwrap: str | None  # None: no isolation available
    python: str
    run_as: int | None  # uid bwrap starts as (root callers: nobody)
    why_not: str = ""
    cgroups: CgroupSupport = NO_CGROUP

    @property
    def description(self) -> str:
        if self.bwrap is None:
            return f"UNISOLATED ({self.why_not})"
        return (
            "bubblewrap: user, PID, network, mount namespaces; private /tmp; "
            + self.cgroups.description
        )


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def seccomp_filter(refuse_sockets: bool = False) -> bytes:
    """A classic-BPF seccomp program (``struct sock_filter[]``) for ``bwrap --seccomp``:
    native-ABI calls pass except :data:`SECCOMP_ABI`'s (EPERM); a foreign ABI kills."""
    if SECCOMP_ABI is None:
        raise SandboxUnavailableError(
            f"no seccomp filter for {platform.machine()}: the sandbox cannot refuse shared "
            "memory there"
        )
    arch, always, sockets = SECCOMP_ABI
    refused = always + sockets if refuse_sockets else always
    load_word, jump_eq, jump_ge, ret = 0x20, 0x15, 0x35, 0x06
    allow, errno_eperm, kill = 0x7FFF0000, 0x00050001, 0x80000000
    n = len(refused)
    program = [
        (load_word, 0, 0, 4),  # seccomp_data.arch
        (jump_eq, 1, 0, arch),
        (ret, 0, 0, kill),
        (load_word, 0, 0, 0),  # seccomp_data.nr
        (jump_ge, n + 1, 0, 0x40000000),  # the x32 ABI's numbers
        *((jump_eq, n - i, 0, nr) for i, nr in enumerate(refused)),
        (ret, 0, 0, allow),
        (ret, 0, 0, errno_eperm),
    ]
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


def _seccomp_fd(refuse_sockets: bool = False) -> int:
    """A pipe holding the filter, for bwrap to read (it reads it whole, once)."""
    r, w = os.pipe()
    os.write(w, seccomp_filter(refuse_sockets))
    os.close(w)
    return r


def bwrap_command(
    bwrap: str, python: str, limits: SandboxLimits, info_fd: int, seccomp_fd: int
) -> list[str]:
    tmp_bytes = str(limits.tmp_size_mb << 20)
    cmd = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--clearenv",
    ]
    for key, value in SANDBOX_ENV.items():
        cmd += ["--setenv", key, value]
    for path in SYSTEM_DIRS:
        cmd += ["--ro-bind-try", path, path]
    prefix = str(Path(python).parent.parent)
    if not prefix.startswith("/usr"):  # a pyenv/uv interpreter elsewhere: only its own tree
        cmd += ["--ro-bind", prefix, prefix]
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    cmd += ["--size", tmp_bytes, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    cmd += ["--size", tmp_bytes, "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp"]
    cmd += ["--info-fd", str(info_fd), "--seccomp", str(seccomp_fd)]
    cmd += ["--", python, "-I", "-c"]
    return cmd


def _probe(bwrap: str, python: str, run_as: int | None) -> str:
    """ "" when ``python`` runs in the sandbox, else why not."""
    r, w = os.pipe()
    seccomp = _seccomp_fd()
    try:
        proc = subprocess.run(
            [
                *bwrap_command(bwrap, python, SandboxLimits(), w, seccomp),
                "import json, resource, subprocess",
            ],
            capture_output=True,
            pass_fds=(w, seccomp),
            env=SANDBOX_ENV,
            cwd="/",
            timeout=60,
            **_user_args(run_as),
        )
    except (OSError, subprocess.SubprocessError) as e:
        return repr(e)
    finally:
        os.close(r)
        os.close(w)
        os.close(seccomp)
    return "" if proc.returncode == 0 else proc.stderr.decode(errors="replace").strip()[-300:]


def _user_args(uid: int | None) -> dict[str, Any]:
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _enter_cgroup_as(procs_files: list[str], uid: int | None) -> Any:
    """The child's set-up before bwrap: join the run's cgroup (as root: only then may it), then
    become ``uid``. Everything bwrap starts is then in the cgroup from its first instruction."""

    def setup() -> None:
        for path in procs_files:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return setup


@functools.cache
def find_isolation(python: str | None = None) -> Isolation:
    """The sandbox this machine gives (probed once per process), or why there is none."""
    candidates = [python] if python else [os.path.realpath(sys.executable), "/usr/bin/python3"]
    candidates = [os.path.realpath(c) for c in candidates if c and os.path.exists(c)]
    if not candidates:
        raise FileNotFoundError(f"no Python interpreter for the sandbox: {python!r}")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Isolation(None, candidates[0], None, "bubblewrap (bwrap) is not installed")
    if SECCOMP_ABI is None:
        why = f"no seccomp filter for {platform.machine()} (the sandbox's shared memory)"
        return Isolation(None, candidates[0], None, why)
    run_as = _nobody() if os.geteuid() == 0 else None
    problems = []
    for candidate in dict.fromkeys(candidates):
        problem = _probe(bwrap, candidate, run_as)
        if not problem:
            return Isolation(bwrap, candidate, run_as, cgroups=find_cgroups())
        problems.append(f"{candidate}: {problem}")
    return Isolation(None, candidates[0], None, "bwrap cannot run: " + "; ".join(problems))


def require_isolation(limits: SandboxLimits) -> Isolation:
    """The isolation runs will get; raises when there is none and that is not allowed."""
    isolation = find_isolation(limits.python)
    if isolation.bwrap is None and not limits.allow_unisolated:
        raise SandboxUnavailableError(
            f"cannot isolate model-written code: {isolation.why_not}. Install bubblewrap "
            "(apt-get install bubblewrap) on a kernel that allows unprivileged user namespaces, "
            "or set allow_unisolated: true to run it as this process's user, with its network "
            "and files (unsafe)"
        )
    return isolation


class _Channel:
    """The launcher's report lines, parsed as they arrive, within a byte budget for all of
    them and one for each line (an endless line is cut, not re-scanned chunk after chunk),
    each line only if its shape admits a right answer; when each case's record arrived."""

    def __init__(self, n_cases: int, budget: int, max_line: int, shape: ReportShape) -> None:
        self.records: dict[int, dict[str, Any]] = {}
        self.arrived: dict[int, float] = {}
        self.n_cases = n_cases
        self.budget = budget
        self.max_line = max_line
        self.shape = shape
        self.done = False
        self.over_budget = False
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self.budget -= len(data)
        if self.budget < 0:
            self.over_budget = True
            return
        self._buffer += data
        if b"\n" not in data:
            self.over_budget = len(self._buffer) > self.max_line
            return
        *lines, rest = self._buffer.split(b"\n")
        self._buffer = bytearray(rest)
        for line in lines:
            if not self.shape.admits(line):
                continue  # more than any right answer holds: not worth parsing
            with contextlib.suppress(ValueError, RecursionError):  # garbage is no answer
                record = json.loads(line)
                if not isinstance(record, dict):
                    continue
                if record.get("done") is True:
                    self.done = True
                case = record.get("case")
                if type(case) is int and 0 <= case < self.n_cases and case not in self.records:
                    self.records[case] = record  # the first word on a case counts
                    self.arrived[case] = time.monotonic()


def _resident_bytes(init_pid: int) -> int:
    """Resident memory of every process in the sandbox whose PID-namespace init is
    ``init_pid``, read from the sandbox's own /proc (it lists exactly its processes)."""
    proc = f"/proc/{init_pid}/root/proc"
    total = 0
    with contextlib.suppress(OSError):
        # Until bubblewrap has switched to the sandbox's root, that path is our own /proc.
        if os.stat(proc).st_dev == os.stat("/proc").st_dev:
            return 0
        for name in os.listdir(proc):
            if name.isdigit():
                with (
                    contextlib.suppress(OSError, ValueError, IndexError),
                    open(f"{proc}/{name}/statm", "rb") as f,
                ):
                    total += int(f.read().split()[1]) * PAGE_BYTES
    return total


def _drain(
    proc: subprocess.Popen[bytes],
    channel: _Channel,
    deadline: float,
    init_pid: int | None = None,
    memory_bytes: int = 0,
) -> tuple[bytes, bool, bool]:
    """Read the report and stderr until the launcher is done, exits, the time is up, or
    (``init_pid`` given) the sandbox's processes together hold more than ``memory_bytes``.
    Returns stderr, whether the time ran out, whether the memory did."""
    stderr = bytearray()
    streams = [proc.stdout, proc.stderr]
    next_check = 0.0
    while streams and not channel.done and not channel.over_budget:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(stderr), True, False
        if init_pid is not None:
            # At most every MEMORY_CHECK_S, however fast the program writes.
            if time.monotonic() >= next_check:
                if _resident_bytes(init_pid) > memory_bytes:
                    return bytes(stderr), False, True
                next_check = time.monotonic() + MEMORY_CHECK_S
            left = min(left, max(0.0, next_check - time.monotonic()))
        for stream in select.select(streams, [], [], left)[0]:
            data = os.read(stream.fileno(), 1 << 16)
            if not data:
                streams.remove(stream)
            elif stream is proc.stdout:
                channel.feed(data)
            elif len(stderr) < STDERR_KEPT_BYTES:
                stderr += data[: STDERR_KEPT_BYTES - len(stderr)]
    return bytes(stderr), False, False


def _sandbox_init(info_r: int, deadline: float) -> tuple[int, int] | None:
    """The pid of the sandbox's PID-namespace init and a pidfd of it, from bwrap's
    ``--info-fd`` report."""
    data = b""
    while select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(info_r, 4096)
        if not chunk:
            break
        data += chunk
        with contextlib.suppress(ValueError):
            pid = json.loads(data)["child-pid"]
            return pid, os.pidfd_open(pid)
    return None


def _feed(proc: subprocess.Popen[bytes], job: bytes) -> None:
    with contextlib.suppress(OSError):
        proc.stdin.write(job)
    with contextlib.suppress(OSError):
        proc.stdin.close()


def _stop(proc: subprocess.Popen[bytes], pidfd: int | None, isolated: bool) -> None:
    """Kill everything the run started, and wait until it is gone."""
    if pidfd is not None:
        # The namespace's init dying takes every process in it along; its pidfd turns readable
        # only once they are all gone.
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        select.select([pidfd], [], [], 30)
        os.close(pidfd)
    elif not isolated:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


def _over_time(
    tests: list[TestCase], arrived: dict[int, float], start: float, case_time_s: float
) -> list[bool]:
    """Per case, whether its report reached this process more than ``case_time_s`` (and
    :data:`CASE_TIME_SLACK_S`) after the report before it, in the launcher's order: stdio cases,
    then function calls. Measured here, where a program that silences the launcher's own
    timer, or fools its clock, cannot reach; a program's loading counts toward its first
    function call, as it does toward every stdio case."""
    order = [i for i, c in enumerate(tests) if isinstance(c, StdioCase)]
    order += [i for i, c in enumerate(tests) if not isinstance(c, StdioCase)]
    over = [False] * len(tests)
    previous = start
    for i in order:
        if i in arrived:
            over[i] = arrived[i] - previous > case_time_s + CASE_TIME_SLACK_S
            previous = max(previous, arrived[i])
    return over


def run_code(
    solution: str, tests: list[TestCase], limits: SandboxLimits | None = None
) -> SandboxResult:
    """Run ``solution`` on every case's inputs in a sandbox and compare its outputs here."""
    limits = limits or SandboxLimits()
    isolation = require_isolation(limits)
    isolated = isolation.bwrap is not None
    if not isolated:
        logger.warning("running model-written code UNISOLATED: %s", isolation.why_not)
    job_limits = {
        **limits.model_dump(include={"cpu_time_s", "case_time_s", "memory_mb"}),
        **limits.model_dump(include={"max_file_size_mb", "max_output_bytes"}),
        # Outside a user namespace the process limit would count all of this uid's processes.
        "max_processes": limits.max_processes if isolated else 0,
    }
    job = json.dumps(
        {"source": solution, "cases": [sandbox_job(c) for c in tests], "limits": job_limits}
    ).encode()
    deadline = time.monotonic() + limits.wall_time_s
    workdir = None if isolated else tempfile.mkdtemp(prefix="rl-sandbox-")
    cgroup, cgroup_full = None, False
    if isolated and isolation.cgroups.version is not None:
        # Beside bwrap's init and the launcher, the outer bwrap process is in it too.
        cgroup = RunCgroup(
            isolation.cgroups, limits.memory_mb << 20, limits.max_processes + 3, limits.cpus
        )
    info_r, info_w = os.pipe()
    seccomp = _seccomp_fd(refuse_sockets=cgroup is None) if isolated else -1
    pidfd = init_pid = None
    try:
        if isolated:
            bwrap = bwrap_command(isolation.bwrap, isolation.python, limits, info_w, seccomp)
            command = [*bwrap, LAUNCHER]
        else:
            command = [isolation.python, "-I", "-c", LAUNCHER]
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=SANDBOX_ENV if isolated else {**SANDBOX_ENV, "HOME": workdir},
            cwd="/" if isolated else workdir,
            pass_fds=(info_w, seccomp) if isolated else (),
            start_new_session=not isolated,
            preexec_fn=(
                _enter_cgroup_as(cgroup.procs_files if cgroup else [], isolation.run_as)
                if isolated
                else None
            ),
        )
        os.close(info_w)
        info_w = -1
        if seccomp >= 0:
            os.close(seccomp)
            seccomp = -1
        try:
            if isolated:
                # Before the job is sent: the launcher waits for it, so the init is still alive.
                init = _sandbox_init(info_r, deadline)
                if init is None:
                    proc.kill()
                    err = proc.communicate(timeout=10)[1].decode(errors="replace")
                    raise RuntimeError(f"bubblewrap did not start the sandbox: {err.strip()}")
                init_pid, pidfd = init
            job_sent = time.monotonic()
            threading.Thread(target=_feed, args=(proc, job), daemon=True).start()
            # A case's line: its output JSON-escaped (up to 6 bytes a character), and a little.
            max_line = 6 * limits.max_output_bytes + 1024
            shape = ReportShape.for_cases(tests)
            channel = _Channel(len(tests), len(tests) * max_line + 4096, max_line, shape)
            memory_bytes = limits.memory_mb << 20
            stderr, timed_out, memory_limited = _drain(
                proc, channel, deadline, init_pid, memory_bytes
            )
        finally:
            _stop(proc, pidfd, isolated)
            proc.stdout.close()
            proc.stderr.close()
    finally:
        if cgroup is not None:
            cgroup_full = cgroup.memory_limited()
            cgroup.remove()
        os.close(info_r)
        if info_w >= 0:
            os.close(info_w)
        if seccomp >= 0:
            os.close(seccomp)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    outputs = [channel.records.get(i) for i in range(len(tests))]
    over_time = _over_time(tests, channel.arrived, job_sent, limits.case_time_s)
    return SandboxResult(
        passed=[
            case_passed(case, out, limits.max_output_bytes) and not late
            for case, out, late in zip(tests, outputs, over_time, strict=True)
        ],
        outputs=outputs,
        timed_out=timed_out,
        stderr=stderr.decode(errors="replace"),
        isolated=isolated,
        isolation=isolation.description,
        output_limited=channel.over_budget,
        memory_limited=memory_limited or cgroup_full,
    )
