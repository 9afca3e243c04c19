"""Runs inside the sandbox, before and around the untrusted program (``python -I -c <this file>``).

It reads one job from stdin (the program and the *inputs* of its test cases: never the expected
outputs), sets the resource limits, then collects the program's outputs and writes them to its
original stdout, one JSON line per case, and a final ``{"done": true}``. Nothing it writes is a
verdict: the trusted side compares the outputs. A program that tampers with this launcher (it
runs in the same process for function-call cases) can only change what is reported as its own
output, which is no better than computing it.

Standard library only: it runs under whatever Python the sandbox can execute.
"""

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time

dumps = json.dumps  # bound before the program runs, which may replace json.dumps
monotonic = time.monotonic


class CaseTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise CaseTimeout


def limit_cpu(seconds):
    # The soft limit sends SIGXCPU, the hard one a second later SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))


def set_limits(limits, n_calls):
    mb = 1 << 20
    for which, value in (
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, limits["max_file_size_mb"] * mb),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))
    # Function-call cases share this process: each gets its share of CPU time.
    limit_cpu(limits["cpu_time_s"] * max(1, n_calls))
    if limits["max_processes"]:
        # Set only here, inside the sandbox's own user namespace: the kernel then counts this
        # sandbox's processes, not every process of the uid it maps to.
        n = limits["max_processes"]
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))


def run_stdio_case(i, stdin, limits, report):
    """The program as a fresh process, ``stdin`` on its stdin, its stdout kept in a file."""
    cap = limits["max_output_bytes"]
    with open(f"case{i}.in", "w", encoding="utf-8") as f:
        f.write(stdin)
    with open(f"case{i}.in", "rb") as fin, open(f"case{i}.out", "wb") as fout:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "solution.py"],
                stdin=fin,
                stdout=fout,
                start_new_session=True,
                preexec_fn=lambda: limit_cpu(limits["cpu_time_s"]),
            )
        except OSError as e:
            report(i, error=f"could not start: {e}")
            return
    try:
        proc.wait(timeout=limits["case_time_s"])
        error = None
    except subprocess.TimeoutExpired:
        error = f"no exit within {limits['case_time_s']} s"
    with contextlib.suppress(OSError):  # what it left running would only cost CPU
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    with open(f"case{i}.out", "rb") as f:
        out = f.read(cap + 1)
    for name in (f"case{i}.in", f"case{i}.out"):
        os.unlink(name)
    if error is None and len(out) > cap:
        error = f"more than {cap} bytes of output"
    if error is not None:
        report(i, error=error)
    else:
        report(i, stdout=out.decode("utf-8", errors="replace"), exit_code=proc.returncode)


def main():
    job = json.loads(sys.stdin.buffer.read())
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    # The program's own prints and reads go nowhere: only what is reported counts.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    write, flush = channel.write, channel.flush

    def report(i, **fields):
        try:
            value = fields.pop("value_json", None)
            line = dumps({"case": i, **fields})
            if value is not None:
                line = line[:-1] + ', "value": ' + value + "}"
            write(line + "\n")
            flush()
        except Exception:
            pass

    limits = job["limits"]
    cases = job["cases"]
    set_limits(limits, sum("function" in c for c in cases))
    with open("solution.py", "w", encoding="utf-8") as f:
        f.write(job["source"])
    for i, case in enumerate(cases):
        if "stdin" in case:
            run_stdio_case(i, case["stdin"], limits, report)
    calls = [(i, c) for i, c in enumerate(cases) if "function" in c]
    if calls:
        signal.signal(signal.SIGALRM, on_alarm)
        namespace = {"__name__": "solution"}
        try:
            exec(compile(job["source"], "solution.py", "exec"), namespace)
            load_error = None
        except BaseException as e:  # SystemExit too: a program that exits has no functions
            load_error = f"loading the program: {type(e).__name__}: {e}"
        for i, case in calls:
            if load_error:
                report(i, error=load_error)
                continue
            try:
                started = monotonic()
                signal.setitimer(signal.ITIMER_REAL, limits["case_time_s"])
                value = namespace[case["function"]](*case["args"], **case["kwargs"])
                signal.setitimer(signal.ITIMER_REAL, 0)
                # A function that caught the timer's exception and returned late is still late.
                if monotonic() - started > limits["case_time_s"]:
                    report(i, error=f"no return within {limits['case_time_s']} s")
                    continue
                value_json = dumps(value)
                if len(value_json) > limits["max_output_bytes"]:
                    report(i, error=f"more than {limits['max_output_bytes']} bytes of output")
                    continue
                report(i, value_json=value_json)
            except BaseException as e:
                signal.setitimer(signal.ITIMER_REAL, 0)
                report(i, error=f"{type(e).__name__}: {e}"[:500])
    write(dumps({"done": True}) + "\n")
    flush()
    os._exit(0)  # no atexit handlers or finalizers of the program run after the report


main()
