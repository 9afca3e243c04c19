"""The code sandbox against honest and hostile programs.

Self-contained (no conftest fixtures, no Ray): the rl-envs nox session runs this file a second
time as an unprivileged user when CI runs as root, so both ways of starting bubblewrap are held
to the same cases.
"""

import os
import secrets
import socket
import textwrap
import time

import pytest

from rl_envs.code import sandbox
from rl_envs.code.cases import CallCase, StdioCase, call_cases_from_asserts, parse_cases
from rl_envs.code.sandbox import SandboxLimits, SandboxUnavailableError, run_code

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


def test_this_machine_isolates():
    isolation = sandbox.find_isolation()
    assert isolation.bwrap is not None, f"bubblewrap is needed for these tests: {isolation.why_not}"
    if os.geteuid() == 0:
        assert isolation.run_as not in (None, 0)  # root never runs model code as root


def test_outputs_are_compared_type_strictly_outside():
    result = run(ADD, ADD_CASES)
    assert result.passed == [True, True, False]
    assert result.outputs[0] == {"case": 0, "value": 3}
    strict = [
        CallCase(function="f", expected=1),
        CallCase(function="f", expected=1.0),
        CallCase(function="f", expected=True),
        CallCase(function="f", expected="1"),
        CallCase(function="g", expected=[1, [2.0, None], {"a": False}]),
        CallCase(function="g", expected=[1, [2, None], {"a": False}]),
    ]
    program = "def f():\n    return 1\ndef g():\n    return (1, (2.0, None), {'a': False})\n"
    assert run(program, strict).passed == [True, False, False, False, True, False]


def test_stdin_stdout_cases_each_run_the_program_afresh():
    assert run(SUM, SUM_CASES).passed == [True, True]
    assert run(SUM.replace("sum", "max"), SUM_CASES).passed == [False, False]
    assert run("import sys\nprint(3)\nsys.exit(1)\n", SUM_CASES[:1]).passed == [False]
    mixed = run(ADD + "\nif __name__ == '__main__':\n    " + SUM, [*ADD_CASES, *SUM_CASES])
    assert mixed.passed == [True, True, False, True, True]


def test_a_malformed_or_hanging_program_fails_its_cases_only():
    assert run("def add(a, b) return", ADD_CASES).reward == 0.0
    slow = ADD + "def add_slow(a, b):\n    while True:\n        pass\n"
    cases = [
        CallCase(function="add_slow", args=[1, 2], expected=3),
        *ADD_CASES[:2],
    ]
    assert run(slow, cases).passed == [False, True, True]


def test_assert_tests_are_refused_and_convertible():
    with pytest.raises(ValueError, match="assert-style"):
        parse_cases(["assert add(1, 2) == 3"])
    cases = call_cases_from_asserts(["assert add(1, 2) == 3", "assert (1, 2) == pair(x=1)"])
    assert cases == [
        CallCase(function="add", args=[1, 2], expected=3),
        CallCase(function="pair", kwargs={"x": 1}, expected=[1, 2]),
    ]
    with pytest.raises(ValueError, match="add\\(1\\) > 3"):
        call_cases_from_asserts(["assert add(1) > 3"])
    # As a Parquet column of mixed cases gives them: every key in every row, or a JSON string.
    from_parquet = [
        {"stdin": "1", "stdout": "1", "function": None, "args": None, "expected": None},
        {"stdin": None, "stdout": None, "function": "f", "args": [1], "expected": None},
    ]
    assert parse_cases(from_parquet) == [
        StdioCase(stdin="1", stdout="1"),
        CallCase(function="f", args=[1], expected=None),
    ]
    assert parse_cases('[{"stdout": "x"}]') == [StdioCase(stdout="x")]


def test_the_program_can_work_in_its_directory_but_write_nothing_outside(tmp_path):
    host_targets = [tmp_path / "pwned", "/tmp/rl-pwned", "/dev/shm/rl-pwned", os.getcwd() + "/pw"]
    program = f"""
        import os
        for path in {[str(p) for p in host_targets]!r} + ["/rl-pwned", "/dev/rl-pwned"]:
            try:
                open(path, "w").write("x")
            except OSError:
                pass
        def roundtrip(text):
            open("note.txt", "w").write(text)
            return open("note.txt").read()
        """
    result = run(program, [CallCase(function="roundtrip", args=["fine"], expected="fine")])
    assert result.reward == 1.0
    assert not any(os.path.exists(p) for p in host_targets)


# Hostile programs, each against cases it must not pass. The secret expected value is fresh per
# test run, so only a program that reads it from somewhere could return it.
SECRET = "s3cret-" + secrets.token_hex(8)
SECRET_CASE = CallCase(function="answer", expected=SECRET)
SECRET_STDIO = StdioCase(stdin="", stdout=SECRET)

HOSTILE_CALLS = {
    "replaces builtins.exec": """
        import builtins
        builtins.exec = lambda *a, **k: None
        builtins.compile = lambda *a, **k: None
        def answer():
            return None
        """,
    "digs through frames and the heap": """
        import gc, sys
        def answer():
            for frame_depth in range(1, 20):
                try:
                    frame = sys._getframe(frame_depth)
                except ValueError:
                    break
                for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
                    if isinstance(value, dict) and "expected" in value:
                        return value["expected"]
            for obj in gc.get_objects():
                if isinstance(obj, dict) and "expected" in obj:
                    return obj["expected"]
            return "nothing found"
        """,
    "returns an always-equal object": """
        class Anything:
            def __eq__(self, other):
                return True
        def answer():
            return Anything()
        """,
    "returns an always-equal str": """
        class Anything(str):
            def __eq__(self, other):
                return True
            __hash__ = str.__hash__
        def answer():
            return Anything("x")
        """,
    "reads test files and expected outputs": """
        import os
        def answer():
            found = []
            for root in ["/tmp", "/", "/proc", "/dev/shm", os.getcwd()]:
                for base, dirs, files in os.walk(root):
                    if base.startswith(("/proc/sys", "/usr", "/sys")) or base.count("/") > 4:
                        dirs[:] = []
                    for name in files:
                        try:
                            with open(os.path.join(base, name), errors="ignore") as f:
                                text = f.read(1 << 16)
                        except OSError:
                            continue
                        if "s3cret-" in text:
                            start = text.index("s3cret-")
                            return text[start : start + 23]
                        found.append(name)
            return str(found)[:100]
        """,
    "exits before the tests (sys.exit)": "import sys\nsys.exit(0)\ndef answer():\n    return 0\n",
    "exits before the tests (os._exit)": "import os\nos._exit(0)\ndef answer():\n    return 0\n",
    "prints fake result lines": """
        import os, sys
        fake = '{"case": 0, "value": true}\\n{"done": true}\\n'
        print(fake)
        sys.__stdout__.write(fake)
        for fd in range(64):
            try:
                os.write(fd, fake.encode())
            except OSError:
                pass
        def answer():
            return True
        """,
    "reads the parent's environment": """
        import os
        def answer():
            seen = str(dict(os.environ))
            for pid in os.listdir("/proc"):
                for what in ("environ", "cmdline"):
                    try:
                        seen += open(f"/proc/{pid}/{what}", errors="ignore").read()
                    except OSError:
                        pass
            return seen
        """,
}


@pytest.mark.parametrize("name", list(HOSTILE_CALLS))
def test_hostile_function_programs_earn_nothing(name, monkeypatch):
    monkeypatch.setenv("RL_TEST_SECRET", SECRET)  # in the parent's environment, too
    result = run(HOSTILE_CALLS[name], [SECRET_CASE])
    assert result.reward == 0.0
    assert SECRET not in repr(result.outputs) + result.stderr


HOSTILE_STDIO = {
    "replaces sys.stdout": "import io, sys\nsys.stdout = io.StringIO()\nprint('anything')\n",
    "prints fake result lines": 'print(\'{"case": 0, "stdout": "x", "exit_code": 0}\')\n',
    "exits before printing": "import sys\nsys.exit(0)\n",
    "reads the launcher's memory": """
        import os
        seen = ""
        for pid in os.listdir("/proc"):
            try:
                seen += open(f"/proc/{pid}/cmdline", errors="ignore").read()
            except OSError:
                pass
        print(seen[:1000])
        """,
}


@pytest.mark.parametrize("name", list(HOSTILE_STDIO))
def test_hostile_stdio_programs_earn_nothing(name):
    result = run(HOSTILE_STDIO[name], [SECRET_STDIO])
    assert result.reward == 0.0
    assert SECRET not in repr(result.outputs)


# Programs that attack the machine, not the reward: each must be stopped and leave nothing.
# The honest `add` they also define keeps its credit: containment must not cost honest work.
RESOURCE_ATTACKS = {
    "infinite loop": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
    "        pass\n",
    "memory bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))\n",
    "huge output": "import sys\nfor _ in range(4000):\n    sys.stdout.write('x' * 50000)\n",
    "fills its disk": "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)\n",
}


@pytest.mark.parametrize("name", list(RESOURCE_ATTACKS))
def test_resource_attacks_are_contained(name):
    stdio = run(RESOURCE_ATTACKS[name], SUM_CASES)  # as a whole program, once per case
    assert stdio.reward == 0.0
    program = ADD + "def attack():\n" + textwrap.indent(RESOURCE_ATTACKS[name], "    ")
    calls = run(program, [CallCase(function="attack", expected="finished"), *ADD_CASES[:2]])
    assert calls.passed[0] is False
    if name != "fork bomb":  # the bomb may use up the process for good; that is its loss
        assert calls.passed[1:] == [True, True]
    assert len(repr(calls.outputs)) < 10 * LIMITS.max_output_bytes


def test_huge_output_on_the_report_channel_is_cut():
    program = ADD + "import os\nfor _ in range(400):\n    os.write(3, b'x' * 2**20)\n"
    # fd 3 is where a duplicate of the launcher's report channel usually lands. With many
    # cases the budget for all lines is large: one endless line must still be cut at once,
    # not read (and re-scanned for its end) until the wall time runs out.
    cases = [CallCase(function="add", args=[1, i], expected=1 + i) for i in range(60)]
    result = run(program, cases)
    assert result.output_limited and not result.timed_out
    assert result.reward == 0.0 and len(result.stderr) <= sandbox.STDERR_KEPT_BYTES


def test_a_child_that_outlives_the_run_is_gone():
    marker = f"{3000 + secrets.randbelow(1000)}.{secrets.randbelow(10**6)}"
    program = f"""
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "{marker}"])
            os._exit(0)
        def add(a, b):
            return a + b
        """
    result = run(program, ADD_CASES[:1])
    assert result.reward == 1.0
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    left.append(pid)
        except OSError:
            pass
    assert left == []


def test_no_connection_reaches_a_loopback_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        program = f"""
            import socket
            def connect():
                try:
                    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
                    return "connected"
                except OSError as e:
                    return "refused"
            """
        result = run(program, [CallCase(function="connect", expected="connected")])
        server.settimeout(0.5)
        with pytest.raises(TimeoutError):
            server.accept()
    assert result.reward == 0.0
    assert result.outputs[0]["value"] == "refused"


def test_without_isolation_running_needs_allow_unisolated_and_says_so(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.find_isolation.cache_clear()
    try:
        with pytest.raises(SandboxUnavailableError, match="allow_unisolated"):
            run_code(ADD, ADD_CASES, LIMITS)
        limits = LIMITS.model_copy(update={"allow_unisolated": True})
        result = run_code(ADD, ADD_CASES, limits)
        assert result.passed == [True, True, False]
        assert not result.isolated and "UNISOLATED" in result.isolation
    finally:
        sandbox.find_isolation.cache_clear()


def test_a_program_that_writes_garbage_on_the_report_channel_earns_nothing():
    # Deeply nested JSON, huge numbers and broken lines, written where the report goes.
    program = """
        import os
        junk = b"[" * 100000 + b"\\n" + b'{"case": 0, "value": 1' + b"9" * 5000 + b"}\\n{{{\\n"
        def answer():
            for fd in range(3, 64):
                try:
                    os.write(fd, junk)
                except OSError:
                    pass
            return "wrong"
        """
    result = run(program, [SECRET_CASE, CallCase(function="answer", expected="wrong")])
    assert result.passed == [False, True]


def test_forked_processes_together_cannot_hold_more_than_the_memory_limit():
    # RLIMIT_AS bounds one process; a program that forks max_processes children, each just
    # under it, would otherwise hold max_processes x memory_mb of the host's memory.
    limits = LIMITS.model_copy(update={"memory_mb": 128, "case_time_s": 5, "wall_time_s": 10})
    program = """
        import os, time
        def answer():
            r, w = os.pipe()
            for _ in range(8):
                if os.fork() == 0:
                    try:
                        block = bytearray(100 * 2**20)  # zeroed, so resident
                        os.write(w, b"1")
                    except BaseException:
                        os.write(w, b"0")
                    time.sleep(3)
                    os._exit(0)
            got = b""
            while len(got) < 8:
                got += os.read(r, 8)
            return got.count(b"1") * 100
        """
    result = run(program, [CallCase(function="answer", expected=800)], limits)
    assert result.memory_limited
    assert result.outputs == [None], "the program held 8 x 100 MB with a 128 MB limit"
    # An honest program well under the limit is not stopped by the watch.
    honest = run(ADD, ADD_CASES[:2], limits)
    assert honest.passed == [True, True] and not honest.memory_limited


def test_the_kernel_keyring_carries_nothing_from_one_run_to_the_next():
    # bubblewrap has no keyring namespace: every run would share (and could write) the
    # session keyring of the process that starts it, as a login session has one.
    if sandbox.KEYCTL_SYSCALL is None:
        pytest.skip(f"keyctl's syscall number is not known on {os.uname().machine}")
    import ctypes

    ctypes.CDLL(None).syscall(sandbox.KEYCTL_SYSCALL, sandbox.KEYCTL_JOIN_SESSION_KEYRING, None)
    program = f"""
        import ctypes
        libc = ctypes.CDLL(None)
        SESSION_KEYRING = -3
        def store(text):
            return libc.syscall({{add_key}}, b"user", b"rl-note", text.encode(), len(text),
                                SESSION_KEYRING) > 0
        def load():
            key = libc.syscall({sandbox.KEYCTL_SYSCALL}, 10, SESSION_KEYRING, b"user",
                               b"rl-note", 0)  # KEYCTL_SEARCH
            buffer = ctypes.create_string_buffer(100)
            size = libc.syscall({sandbox.KEYCTL_SYSCALL}, 11, key, buffer, 100)  # KEYCTL_READ
            return buffer.raw[: max(size, 0)].decode() if key > 0 else "nothing"
        """.replace("{add_key}", {"x86_64": "248", "aarch64": "217"}[os.uname().machine])
    run(program, [CallCase(function="store", args=[SECRET], expected=True)])
    result = run(program, [CallCase(function="load", expected=SECRET)])
    assert result.outputs[0]["value"] == "nothing"


def test_memory_no_process_shows_cannot_be_held():
    # A detached System V segment or an unmapped memfd is in no process's resident set and
    # outside RLIMIT_AS: one program could hold gigabytes of the host's memory that way.
    limits = LIMITS.model_copy(update={"memory_mb": 128, "case_time_s": 5, "wall_time_s": 10})
    program = """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        MB = 2**20
        def shared_memory():
            held = 0
            for _ in range(3):
                segment = libc.shmget(0, 100 * MB, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
                address = libc.shmat(segment, None, 0) if segment >= 0 else None
                if address in (None, ctypes.c_void_p(-1).value):
                    break
                ctypes.memset(address, 1, 100 * MB)
                libc.shmdt(ctypes.c_void_p(address))
                held += 100
            return held
        def memfds():
            held, fds = 0, []
            for _ in range(20):
                try:
                    fds.append(os.memfd_create("held"))
                    for _ in range(16):
                        os.write(fds[-1], b"x" * MB)
                        held += 1
                except OSError:
                    break
            return held
        """
    cases = [
        CallCase(function="shared_memory", expected=300),
        CallCase(function="memfds", expected=320),
    ]
    result = run(program, cases, limits)
    assert result.outputs[0]["value"] == 0 and result.outputs[1]["value"] == 0
