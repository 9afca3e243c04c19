"""The current Python stack of workers that do not answer, read from outside the process.

A worker stuck in a deadlocked collective, an infinite loop or stopped by ``SIGSTOP`` cannot be
asked anything through Ray: its one thread is busy. So a small task on the worker's node reads
the stack from outside: with ``py-spy dump --nonblocking`` (py-spy comes with ``ray[default]``;
it reads the process's memory, so it works on a stopped process too) or, where ptrace is not
allowed (e.g. Yama ``ptrace_scope`` >= 1 on a stock Ubuntu host), by sending ``SIGUSR1``, on
which the worker's faulthandler writes every thread's stack to its stderr log. A stopped process
cannot run that handler; the report then says the process is stopped.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

#: The signal on which workers write their stacks (``faulthandler.register`` in the worker).
STACK_SIGNAL = signal.SIGUSR1
#: Which tools to try, in order. ``faulthandler`` alone is the fallback when ptrace is denied.
STACK_TOOLS: tuple[str, ...] = ("py-spy", "faulthandler")
#: How long one stack read may take before we give up on it.
DUMP_TIMEOUT_S = 15.0

_PROCESS_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible wait (usually I/O)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "a zombie",
}


def process_state(pid: int) -> str:
    """What the kernel says the process is doing (``/proc/<pid>/stat``), in words."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    code = stat.rsplit(")", 1)[1].split()[0]
    return _PROCESS_STATES.get(code, code)


def _py_spy() -> str | None:
    beside_python = Path(sys.executable).parent / "py-spy"
    return str(beside_python) if beside_python.is_file() else shutil.which("py-spy")


def _dump_with_py_spy(pid: int) -> tuple[str | None, str]:
    tool = _py_spy()
    if tool is None:
        return None, "py-spy is not installed on this node"
    try:
        done = subprocess.run(
            [tool, "dump", "--pid", str(pid), "--nonblocking"],
            capture_output=True,
            text=True,
            timeout=DUMP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return None, f"py-spy took longer than {DUMP_TIMEOUT_S:.0f}s"
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[0]
        return None, f"py-spy failed: {reason}"
    return done.stdout.strip(), ""


def _dump_with_faulthandler(pid: int, stderr_path: str | None) -> tuple[str | None, str]:
    if not stderr_path or not os.path.isfile(stderr_path):
        return None, "the worker's stderr log is not on this node"
    if process_state(pid).startswith("stopped"):
        return None, "a stopped process cannot run its faulthandler"
    start = os.path.getsize(stderr_path)
    os.kill(pid, STACK_SIGNAL)
    deadline = time.monotonic() + min(DUMP_TIMEOUT_S, 5.0)
    text = ""
    while time.monotonic() < deadline:
        time.sleep(0.2)
        with open(stderr_path, errors="replace") as log:
            log.seek(start)
            text = log.read()
        # faulthandler writes one block per thread, each "Thread 0x... (most recent call first)"
        # followed by frames; a pause in growth means it is done.
        if "most recent call first" in text and text.endswith("\n"):
            time.sleep(0.2)
            with open(stderr_path, errors="replace") as log:
                log.seek(start)
                return log.read().strip(), ""
    return None, "the worker did not answer the faulthandler signal"


def python_stack(pid: int, stderr_path: str | None, tools: tuple[str, ...]) -> str:
    """The Python stack of process ``pid`` on this node, or why it could not be read."""
    state = process_state(pid)
    reasons = []
    for tool in tools:
        if tool == "py-spy":
            stack, why = _dump_with_py_spy(pid)
        elif tool == "faulthandler":
            stack, why = _dump_with_faulthandler(pid, stderr_path)
        else:
            raise ValueError(f"unknown stack tool {tool!r}; known: py-spy, faulthandler")
        if stack:
            return f"process {pid} is {state}; its Python stack ({tool}):\n{stack}"
        reasons.append(why)
    return f"process {pid} is {state}; no Python stack: {'; '.join(reasons)}"


#: How long a hang report waits for all stacks together: the workers are read in parallel, each
#: by at most py-spy then faulthandler, so this does not grow with the number of workers.
STACKS_TIMEOUT_S = DUMP_TIMEOUT_S + 5.0 + 10.0


@ray.remote(num_cpus=0)
def _stack_on_its_node(pid: int, stderr_path: str | None, tools: tuple[str, ...]) -> str:
    return python_stack(pid, stderr_path, tools)


def collect_stacks(placements: list[dict], timeout: float | None = None) -> list[str]:
    """The stack of each worker (``placement`` as from ``WorkerHost.describe``), read on its node.

    One small task per worker, all at once, under one deadline (``timeout``, default
    ``STACKS_TIMEOUT_S``): a worker whose stack cannot be read in time costs neither the others
    their stacks nor the report more time. Never raises: a stack that cannot be read says why.
    """
    timeout = STACKS_TIMEOUT_S if timeout is None else timeout
    stacks = ["no Python stack: the worker never reported where it runs"] * len(placements)
    tasks = {}
    for i, info in enumerate(placements):
        if not info.get("node_id"):
            continue
        task = _stack_on_its_node.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=info["node_id"], soft=False)
        ).remote(info["pid"], info.get("stderr"), STACK_TOOLS)
        tasks[task] = i
    if not tasks:
        return stacks
    ready, late = ray.wait(list(tasks), num_returns=len(tasks), timeout=timeout)
    for task in ready:
        try:
            stacks[tasks[task]] = ray.get(task)
        except Exception as err:  # the node may be gone too; the report must still come out
            stacks[tasks[task]] = (
                f"no Python stack: reading it failed ({type(err).__name__}: {err})"
            )
    for task in late:
        stacks[tasks[task]] = f"no Python stack: reading it took longer than {timeout:.0f}s"
        ray.cancel(task)  # a stuck reader is not left behind (its py-spy is killed with it)
    return stacks
