import os
import socket
import textwrap

import pytest

from rl_envs.code.sandbox import SandboxLimits, run_tests

LIMITS = SandboxLimits(cpu_time_s=1, wall_time_s=2.5, memory_mb=512, max_processes=16)
ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 1"]


def live_processes(uid: int | None, workdir: str) -> list[int]:
    """Processes still alive (zombies aside) that ran as the sandbox's uid or inside its dir."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            cwd = os.readlink(f"/proc/{pid}/cwd") if uid is None else ""
        except OSError:
            continue
        if status["State"].strip().startswith("Z"):
            continue
        if (uid is not None and int(status["Uid"].split()[0]) == uid) or cwd.startswith(workdir):
            found.append(int(pid))
    return found


def run_contained(solution: str, tests=TESTS, limits=LIMITS):
    result = run_tests(textwrap.dedent(solution), tests, limits)
    assert not os.path.exists(result.workdir), "the working directory was left behind"
    assert live_processes(result.uid, result.workdir) == [], "processes were left behind"
    return result


def test_a_correct_program_passes_and_a_partly_wrong_one_gets_partial_credit():
    assert run_contained(ADD).passed == [True, True, False]
    assert run_contained(ADD.replace("a + b", "a * b")).reward == pytest.approx(1 / 3)
    assert run_contained("def add(a, b) return").reward == 0.0  # malformed


def test_the_sandbox_records_what_isolation_it_got():
    result = run_contained(ADD)
    if os.geteuid() == 0:  # this machine can: the test pins it down
        assert result.network_isolated and result.private_tmp and result.uid is not None


# Each hostile program: (name, solution, expected reward). A program that also defines `add`
# correctly keeps the credit for its tests: containment must not cost honest work.
HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", 0.0),
    "fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        0.0,
    ),
    "memory bomb": ("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))\n", 0.0),
    "huge output": (
        ADD + "import sys\nfor _ in range(2000):\n    sys.stdout.write('x' * 50000)\n",
        2 / 3,
    ),
    "escapes its process group": (
        ADD + "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\n",
        2 / 3,
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_is_contained(name, contained):
    solution, reward = HOSTILE[name]
    result = run_contained(solution)
    assert result.reward == pytest.approx(reward)
    assert len(result.stdout) <= LIMITS.max_output_bytes
    contained.append(name)


def test_writing_outside_the_working_directory(tmp_path, contained):
    target = tmp_path / "pwned"
    result = run_contained(
        ADD
        + "import os\n"
        + f"for path in [{str(target)!r}, '/tmp/rl-pwned']:\n"
        + "    try:\n        open(path, 'w').write('x')\n    except OSError:\n        pass\n"
        + "open('inside', 'w').write('fine')\n",
        tests=[*TESTS[:2], "assert open('inside').read() == 'fine'"],
    )
    assert result.reward == 1.0  # writing in its own directory works
    assert not target.exists()
    if result.private_tmp:
        assert not os.path.exists("/tmp/rl-pwned")
    contained.append("writes outside its directory")


def test_the_parents_environment_is_invisible(monkeypatch, contained):
    monkeypatch.setenv("RL_TEST_SECRET", "hunter2")
    result = run_contained(
        "import os\n"
        "def secret():\n"
        "    found = os.environ.get('RL_TEST_SECRET', '')\n"
        "    try:\n"
        "        found += open(f'/proc/{os.getppid()}/environ').read()\n"
        "    except OSError:\n"
        "        pass\n"
        "    return found\n",
        tests=["assert 'hunter2' not in secret()", "assert 'hunter2' in secret()"],
    )
    assert result.passed == [True, False]
    contained.append("reads the parent's environment")


def test_no_connection_reaches_a_loopback_port(contained):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        result = run_contained(
            "import socket\n"
            "def connect():\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
            "    return True\n",
            tests=["assert connect()"],
        )
        with pytest.raises(TimeoutError):
            server.accept()
    if result.network_isolated:
        assert result.reward == 0.0
        contained.append("connects to a loopback port")
