"""The code sandbox against programs that attack the machine, not the reward: runaway
resources, processes that outlive the run, the network, memory no limit sees, and the kernel
keyrings every process of a uid shares. Each must be stopped and leave nothing.

Self-contained (no conftest fixtures, no Ray; shared helpers in ``sandbox_helpers.py``), run a
second time unprivileged by the rl-envs nox session, as ``test_sandbox.py`` is.
"""

import ctypes
import os
import secrets
import socket
import textwrap
import threading
import time

import pytest

from rl_envs.code import sandbox
from rl_envs.code.cases import CallCase
from rl_envs.code.sandbox import run_code

from .sandbox_helpers import ADD, ADD_CASES, LIMITS, SECRET, SUM_CASES, run, sandbox_processes

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
