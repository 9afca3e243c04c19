"""The code sandbox against honest and hostile programs.

Self-contained (no conftest fixtures, no Ray): the rl-envs nox session runs this file a second
time as an unprivileged user when CI runs as root, so both ways of starting bubblewrap are held
to the same cases.
"""

import ctypes
import os
import secrets
import socket
import textwrap
import threading
import time
import tracemalloc

import pytest

from rl_envs.code import sandbox
from rl_envs.code.cases import (
    CallCase,
    StdioCase,
    call_cases_from_asserts,
    case_passed,
    parse_cases,
    same_json_value,
)
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
        # Root can make cgroups wherever the kernel has a memory controller (this project's
        # machines do): a run without one would leave kernel memory unbounded.
        assert isolation.cgroups.version is not None, isolation.cgroups.why_not
    assert isolation.cgroups.description in isolation.description


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


# Kernel keyrings have no namespace: sandboxed code shares them with every process of its uid.
ADD_KEY, REQUEST_KEY, KEYCTL = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}[
    os.uname().machine
]
KEYS = f"""
    import ctypes, time
    libc = ctypes.CDLL(None, use_errno=True)
    def add_keys(n, description="rl-key", wait_s=0.0):
        made = 0
        for i in range(n):
            made += libc.syscall({ADD_KEY}, b"user", f"{{description}}-{{i}}".encode(), b"x", 1,
                                 ctypes.c_long(-4)) > 0  # the user keyring
        time.sleep(wait_s)
        return made
    def read_key(serial):
        buffer = ctypes.create_string_buffer(200)
        size = libc.syscall({KEYCTL}, 11, ctypes.c_long(serial), buffer, 200)  # KEYCTL_READ
        return buffer.raw[:size].decode() if size >= 0 else "refused"
    def find_key(prefix, wait_s):
        deadline = time.monotonic() + wait_s
        while True:  # /proc/keys lists the keys this uid may see
            keys = open("/proc/keys").read()
            if prefix in keys or time.monotonic() > deadline:
                return keys
            time.sleep(0.05)
"""


def sandbox_uid_keys() -> int:
    """Keys the kernel holds for the uid sandboxed code runs as (/proc/key-users)."""
    uid = sandbox.find_isolation().run_as
    uid = os.getuid() if uid is None else uid
    with open("/proc/key-users") as f:
        for line in f:
            owner, fields = line.split(":", 1)
            if int(owner) == uid:
                return int(fields.split()[1].split("/")[0])
    return 0


def test_keys_a_program_adds_do_not_outlive_its_run():
    before = sandbox_uid_keys()
    result = run(KEYS, [CallCase(function="add_keys", args=[20], expected=0)])
    assert sandbox_uid_keys() <= before, "the run's keys outlived it"
    assert result.passed == [True]


def test_a_program_cannot_use_up_the_key_quota_of_other_runs():
    # The uid's key quota (200 keys) is shared by every run: filled, later runs have none.
    before, peak = sandbox_uid_keys(), [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], sandbox_uid_keys())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run(KEYS, [CallCase(function="add_keys", args=[250, "fill", 1.5], expected=0)])
    finally:
        done.set()
        watcher.join()
    assert peak[0] <= before, f"the run held {peak[0] - before} of its uid's keys"


def test_a_program_cannot_read_a_key_the_verifier_holds():
    # A key of this process, readable by other users: the program is even told its serial.
    libc = ctypes.CDLL(None, use_errno=True)
    serial = libc.syscall(
        ADD_KEY, b"user", b"rl-verifier-key", SECRET.encode(), len(SECRET), ctypes.c_long(-2)
    )
    assert serial > 0, os.strerror(ctypes.get_errno())
    try:
        # KEYCTL_SETPERM: all for us; view and read for everyone else.
        assert libc.syscall(KEYCTL, 5, ctypes.c_long(serial), ctypes.c_long(0x3F3F0003)) == 0
        result = run(KEYS, [CallCase(function="read_key", args=[serial], expected=SECRET)])
    finally:
        libc.syscall(KEYCTL, 21, ctypes.c_long(serial))  # KEYCTL_INVALIDATE
    assert result.reward == 0.0 and result.outputs[0]["value"] == "refused"


def test_concurrent_runs_pass_nothing_through_keys():
    # One run writes the secret into a key's description and waits; another, running at the
    # same time, lists the keys it can see.
    limits = LIMITS.model_copy(update={"case_time_s": 5, "wall_time_s": 8})
    write = [CallCase(function="add_keys", args=[1, "rl-note-" + SECRET, 4.0], expected=0)]
    writer = threading.Thread(target=run_code, args=(textwrap.dedent(KEYS), write, limits))
    writer.start()
    try:
        read = [CallCase(function="find_key", args=["rl-note-", 3.5], expected="")]
        reader = run_code(textwrap.dedent(KEYS), read, limits)
    finally:
        writer.join()
    assert reader.isolated and sandbox_processes() == []
    assert SECRET not in reader.outputs[0]["value"]


def test_socket_buffers_count_against_the_memory_limit():
    # Kernel socket buffers are in no process's resident memory: one process could hold
    # hundreds of MiB in socket pairs it fills and never reads.
    limits = LIMITS.model_copy(update={"memory_mb": 128, "case_time_s": 5, "wall_time_s": 10})
    program = """
        import socket
        def hold():
            held, sockets = 0, []
            for _ in range(30):
                try:
                    pair = socket.socketpair()
                except OSError:
                    break
                sockets += pair
                for end in pair:
                    end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 20)
                    end.setblocking(False)
                    try:
                        while True:
                            held += end.send(b"x" * 65536)
                    except OSError:
                        pass
            return held >> 20
        """
    result = run(program, [CallCase(function="hold", expected=0)], limits)
    held = (result.outputs[0] or {}).get("value", 0)
    assert held < 128, f"the program held {held} MiB in socket buffers with a 128 MiB limit"
    if sandbox.find_isolation().cgroups.version is not None:
        assert result.memory_limited or held == 0


def test_the_verifier_parses_no_more_than_a_right_answer_holds():
    # Within the output limit a report can still describe millions of tiny objects; parsing
    # them would cost the verifier process hundreds of MiB. Written straight onto the report
    # channel, past the launcher's own output check.
    program = """
        import os
        line = b'{"case": 0, "value": [' + b"[]," * 1_500_000 + b"[]]}\\n"
        def answer():
            for fd in range(3, 64):
                try:
                    os.write(fd, line)
                except OSError:
                    pass
            return [1, 2]
        """
    tracemalloc.start()
    try:
        result = run(program, [CallCase(function="answer", expected=[1, 2])])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, f"the verifier allocated {peak >> 20} MiB"
    assert result.outputs[0]["value"] == [1, 2]  # the line too big to be right was skipped


CATCHES_THE_TIMER = """
    import time
    def answer():
        try:
            time.sleep(3)
        except BaseException:
            time.sleep(1.5)
        return 3
    """
SILENCES_THE_TIMER = """
    import __main__, signal, time
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    __main__.monotonic = lambda: 0.0  # the launcher's clock, should it keep one
    def answer():
        time.sleep(3.5)
        return 3
    """


@pytest.mark.parametrize("program", [CATCHES_THE_TIMER, SILENCES_THE_TIMER])
def test_a_case_past_its_time_limit_fails(program):
    limits = LIMITS.model_copy(update={"case_time_s": 1.0, "wall_time_s": 10})
    result = run(program, [CallCase(function="answer", expected=3)], limits)
    assert result.reward == 0.0


def test_output_over_max_output_bytes_fails():
    limits = LIMITS.model_copy(update={"max_output_bytes": 1000})
    big = "x" * 1200
    cases = [CallCase(function="echo", args=[big], expected=big), StdioCase(stdout=big)]
    program = "import sys\ndef echo(text):\n    return text\nprint('x' * 1200)\n"
    assert run(program, cases, limits).passed == [False, False]
    small = [CallCase(function="echo", args=["x"], expected="x")]
    assert run(program, small, limits).passed == [True]
    # What a tampered launcher might report is held to the limit here as well.
    assert not case_passed(cases[0], {"case": 0, "value": big}, 1000)
    assert not case_passed(cases[1], {"case": 1, "stdout": big, "exit_code": 0}, 1000)


def test_the_comparison_rules_of_the_docstring():
    expected = StdioCase(stdout="1 2\nthree\n")
    for output, right in [
        ("1 2\nthree\n", True),
        ("1 2  \t\r\nthree\n\n\n", True),  # trailing spaces, CRLF, trailing empty lines
        ("1 2\u2028three", False),  # a Unicode line separator is not a line break
        ("1 2\x85three", False),
        ("1 2\x0bthree", False),
        ("1 2\nthree\x0c", False),  # control characters are not whitespace
        ("1 2\nthree\u00a0", False),  # nor is a no-break space
        (" 1 2\nthree", False),  # leading spaces count
    ]:
        record = {"case": 0, "stdout": output, "exit_code": 0}
        assert case_passed(expected, record, 1000) is right, repr(output)
    # Floats: relative to the expected value's magnitude, never an absolute allowance.
    assert not same_json_value(8e-10, 1e-10)
    assert same_json_value(1e-10 * (1 + 5e-7), 1e-10)
    assert same_json_value(1e6 + 0.5, 1e6) and not same_json_value(1e6 + 2.0, 1e6)
    assert same_json_value(1e-13, 0.0) and not same_json_value(1e-9, 0.0)
    assert same_json_value(float("inf"), float("inf")) and not same_json_value(1e308, float("inf"))
    assert same_json_value(float("nan"), float("nan")) and not same_json_value(0.0, float("nan"))
