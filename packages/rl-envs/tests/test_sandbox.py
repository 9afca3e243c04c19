"""The code sandbox against honest programs and programs after the reward: the rules a case is
judged by, and the cheats that must earn nothing. Programs that attack the machine are in
``test_sandbox_containment.py``.

Self-contained (no conftest fixtures, no Ray; shared helpers in ``sandbox_helpers.py``): the
rl-envs nox session runs the sandbox tests a second time as an unprivileged user when CI runs as
root, so both ways of starting bubblewrap are held to the same cases.
"""

import os
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
from rl_envs.code.sandbox import SandboxUnavailableError, run_code

from .sandbox_helpers import ADD, ADD_CASES, LIMITS, SECRET, SUM, SUM_CASES, run


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


# Hostile programs, each against cases it must not pass (their expected SECRET is fresh per
# test run, so only a program that reads it from somewhere could return it).
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


def test_huge_output_on_the_report_channel_is_cut():
    program = ADD + "import os\nfor _ in range(400):\n    os.write(3, b'x' * 2**20)\n"
    # fd 3 is where a duplicate of the launcher's report channel usually lands. With many
    # cases the budget for all lines is large: one endless line must still be cut at once,
    # not read (and re-scanned for its end) until the wall time runs out.
    cases = [CallCase(function="add", args=[1, i], expected=1 + i) for i in range(60)]
    result = run(program, cases)
    assert result.output_limited and not result.timed_out
    assert result.reward == 0.0 and len(result.stderr) <= sandbox.STDERR_KEPT_BYTES


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
