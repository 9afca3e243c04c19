"""Run model-written Python against tests in a separate, limited, throw-away process.

What the child gets, set up between ``fork`` and ``exec`` (``preexec_fn``):

* resource limits: CPU time, address space, process count, file size, open files, no core dumps;
* its own process group, killed as a whole on timeout;
* an empty temporary working directory, removed afterwards, and a cleared environment;
* its own network namespace where the kernel lets us make one (as root; an unprivileged caller
  usually may not), where not even the host's loopback is reachable;
* when running as root: its own mount namespace with fresh ``tmpfs`` over ``/tmp``, ``/var/tmp``
  and ``/dev/shm`` (so stray files vanish with it), and a *fresh* user id with no groups. The
  unused uid makes the process-count limit count only this sandbox, lets nothing outside the
  working directory be written, hides the host processes' ``/proc/*/environ``, and lets us kill
  every process the program started, even ones that left the process group. Without root, the
  program runs as the caller: the process limit then counts all of the caller's processes and
  threads, and only the process group is killed.

Which of these happened is recorded in :class:`SandboxResult`. Tests run in the same process as
the solution, each reporting on stdout under a per-run random nonce the program never sees in its
files, arguments or environment; a solution that digs the nonce out of the harness's memory can
still fake a pass. That is reward hacking to watch for, not a way out of the sandbox.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from rl_distributed.config import ConfigModel

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 1 << 18
PR_SET_PDEATHSIG = 1
#: Fresh uids are drawn from here: far above any real account's.
UID_RANGE = (1_000_000, 2_000_000_000)
PRIVATE_TMP_DIRS = (b"/tmp", b"/var/tmp", b"/dev/shm")

_libc = ctypes.CDLL(None, use_errno=True)

HARNESS = r"""
import json, sys
def _run():
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    tests = json.load(open("tests.json"))
    with open("solution.py") as f:
        code = compile(f.read(), "solution.py", "exec")
    namespace = {"__name__": "solution"}
    try:
        exec(code, namespace)
        loaded = True
    except BaseException:
        loaded = False
    for i, test in enumerate(tests):
        ok = False
        if loaded:
            try:
                exec(compile(test, f"test_{i}", "exec"), namespace)
                ok = True
            except BaseException:
                pass
        sys.stdout.write(f"\n{nonce} {i} {int(ok)}\n")
        sys.stdout.flush()
_run()
"""


class SandboxLimits(ConfigModel):
    """What one sandboxed program may use."""

    cpu_time_s: int = 5
    wall_time_s: float = 10.0
    memory_mb: int = 1024  # address space (RLIMIT_AS), so it counts what is mapped, not touched
    max_processes: int = 16  # processes and threads of the sandbox's (fresh) user
    max_file_size_mb: int = 16
    max_output_bytes: int = (
        65536  # of stdout and of stderr kept for the result; the rest is read and dropped
    )
    isolate_network: bool = True
    drop_privileges: bool = True  # when root: run as a fresh uid in a private mount namespace


@dataclass
class SandboxResult:
    passed: list[bool]
    timed_out: bool
    returncode: int | None
    stdout: str
    stderr: str
    network_isolated: bool
    uid: int | None  # the fresh uid it ran as, None when it ran as the caller
    private_tmp: bool
    workdir: str = field(repr=False, default="")

    @property
    def reward(self) -> float:
        """Fraction of tests passed (0 when there are none)."""
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


def _setup_child(limits: SandboxLimits, uid: int | None, status_fd: int) -> None:
    """Runs in the child between fork and exec: no imports, no allocations worth mentioning."""
    net = limits.isolate_network and _libc.unshare(CLONE_NEWNET) == 0
    mounts = False
    # Mounts must not propagate back to the host: make everything private first.
    if (
        uid
        and _libc.unshare(CLONE_NEWNS) == 0
        and _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
    ):
        mounts = all(
            _libc.mount(b"tmpfs", d, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64m,mode=1777") == 0
            for d in PRIVATE_TMP_DIRS
            if os.path.isdir(d)
        )
    mb = 1 << 20
    for which, value in (
        (resource.RLIMIT_CPU, limits.cpu_time_s),
        (resource.RLIMIT_AS, limits.memory_mb * mb),
        (resource.RLIMIT_NPROC, limits.max_processes),
        (resource.RLIMIT_FSIZE, limits.max_file_size_mb * mb),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        # CPU: the soft limit sends SIGXCPU, the hard one a second later SIGKILL.
        resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
    if uid:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    # After setuid, which clears it: die with our parent (a verifier process killed on timeout).
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.write(status_fd, bytes([net, mounts]))


def _kill_everything_of_uid() -> None:
    """preexec_fn of a helper already running as the sandbox's uid: kill(-1) hits all its
    processes but the caller. Repeat: a fork bomb may fork while the first sweep runs."""
    for _ in range(100):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return


@functools.cache
def _interpreter_for_fresh_uid(probe_uid: int) -> str | None:
    """A Python a fresh uid may run: ours may live under a home only root can enter (pyenv in
    /root), and then the system's is used instead. None when there is none."""
    candidates = [
        sys.executable,
        os.path.realpath(sys.executable),
        shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin"),
    ]
    for python in dict.fromkeys(c for c in candidates if c):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            probe = subprocess.run(
                [python, "-I", "-c", "import json"],
                user=probe_uid,
                group=probe_uid,
                extra_groups=[],
                cwd="/",
                env={},
                capture_output=True,
                timeout=30,
            )
            if probe.returncode == 0:
                return python
    return None


def _cleanup(proc: subprocess.Popen[bytes], uid: int | None) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if uid:
        subprocess.run(
            ["true"], user=uid, group=uid, extra_groups=[], preexec_fn=_kill_everything_of_uid
        )


def _read_output(
    proc: subprocess.Popen[bytes], nonce: bytes, limits: SandboxLimits
) -> tuple[dict[int, bool], bytes, bytes, bool]:
    """Drain stdout/stderr until both close or the wall time runs out; keep only what we need."""
    result_line = re.compile(re.escape(nonce) + rb" (\d+) ([01])\n")
    results: dict[int, bool] = {}
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    tail = b""  # unparsed end of stdout, kept short: a result line is < 128 bytes
    deadline = time.monotonic() + limits.wall_time_s
    open_streams = [proc.stdout, proc.stderr]
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            return results, bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), True
        for stream in select.select(open_streams, [], [], left)[0]:
            data = os.read(stream.fileno(), 1 << 16)
            if not data:
                open_streams.remove(stream)
                continue
            room = limits.max_output_bytes - len(kept[stream])
            kept[stream] += data[: max(room, 0)]
            if stream is proc.stdout:
                tail += data
                for m in result_line.finditer(tail):
                    results[int(m.group(1))] = m.group(2) == b"1"
                tail = tail[-128:]
    return results, bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), False


def run_tests(
    solution: str, tests: list[str], limits: SandboxLimits | None = None
) -> SandboxResult:
    """Run ``solution`` then each test (Python statements, e.g. ``assert f(2) == 4``) in a sandbox."""
    limits = limits or SandboxLimits()
    uid = secrets.randbelow(UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0]
    python: str | None = sys.executable
    if limits.drop_privileges and os.geteuid() == 0:
        python = _interpreter_for_fresh_uid(UID_RANGE[0] - 1)
    if python is None or not (limits.drop_privileges and os.geteuid() == 0):
        # No interpreter the fresh uid could run: run as ourselves, with everything else.
        python, uid = sys.executable, None
    workdir = tempfile.mkdtemp(prefix="rl-sandbox-")
    status_r, status_w = os.pipe()
    try:
        for name, text in (
            ("solution.py", solution),
            ("tests.json", json.dumps(tests)),
        ):
            with open(os.path.join(workdir, name), "w") as f:
                f.write(text)
        if uid:
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
            for name in os.listdir(workdir):
                os.chown(os.path.join(workdir, name), uid, uid)
        nonce = secrets.token_hex(16).encode()
        proc = subprocess.Popen(
            # -I: ignore PYTHON* variables and the user's site-packages. The harness comes on
            # the command line: a script path would be resolved through /tmp, which the private
            # mounts hide; the working directory itself stays reachable as ".".
            [python, "-I", "-c", HARNESS],
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: _setup_child(limits, uid, status_w),
        )
        os.close(status_w)
        status_w = -1
        status = os.read(status_r, 2)
        try:
            try:
                proc.stdin.write(nonce + b"\n")
                proc.stdin.close()
            except BrokenPipeError:
                pass
            results, out, err, timed_out = _read_output(proc, nonce, limits)
        finally:
            _cleanup(proc, uid)
            proc.stdout.close()
            proc.stderr.close()
        return SandboxResult(
            passed=[results.get(i, False) for i in range(len(tests))],
            # Killed by the CPU-time limit counts as a timeout too.
            timed_out=timed_out or proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL),
            returncode=proc.returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            network_isolated=len(status) == 2 and bool(status[0]),
            uid=uid,
            private_tmp=len(status) == 2 and bool(status[1]),
            workdir=workdir,
        )
    finally:
        os.close(status_r)
        if status_w >= 0:
            os.close(status_w)
        shutil.rmtree(workdir, ignore_errors=True)
