"""What the sandbox tests share: their limits, an honest program of each kind with its cases,
a secret only a cheating program could return, and ``run``, which also checks that no process
of the sandbox outlives the run.

Like the tests, it needs no conftest fixture and no Ray: the rl-envs nox session copies it with
them when it runs them a second time as an unprivileged user.
"""

import os
import secrets
import textwrap
import time

from rl_envs.code import sandbox
from rl_envs.code.cases import CallCase, StdioCase
from rl_envs.code.sandbox import SandboxLimits, run_code

LIMITS = SandboxLimits(
    cpu_time_s=1, case_time_s=2, wall_time_s=6, memory_mb=512, max_processes=16, tmp_size_mb=16
)
ADD_CASES = [
    CallCase(function="add", args=[1, 2], expected=3),
    CallCase(function="add", args=[-5, 5], expected=0),
    CallCase(function="add", args=[2, 2], expected=5),  # wrong on purpose: no honest pass
]
SUM_CASES = [StdioCase(stdin="1 2\n", stdout="3\n"), StdioCase(stdin="4 5", stdout="9")]
ADD = "def add(a, b):\n    return a + b\n"
SUM = "print(sum(map(int, input().split())))\n"


def sandbox_processes() -> list[int]:
    """Live processes of any sandbox: every one runs the launcher or the program's file."""
    marker = sandbox.LAUNCHER.encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (marker in args or b"solution.py" in args):
            found.append(int(pid))
    return found


def run(solution: str, cases, limits=LIMITS):
    start = time.monotonic()
    result = run_code(textwrap.dedent(solution), cases, limits)
    assert time.monotonic() - start < limits.wall_time_s + 15, "the run was not cut off"
    assert result.isolated, "these tests are about the isolated sandbox"
    assert sandbox_processes() == [], "processes of the sandbox outlived the run"
    return result


# What hostile programs' cases expect: fresh per test run, so only a program that reads it
# from somewhere could return it.
SECRET = "s3cret-" + secrets.token_hex(8)
