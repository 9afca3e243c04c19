"""Agent programs stopped by their rollout: at their deadline, when the rollout stops early,
or before they could hand over how to stop them; a command with what it started."""

import os
import sys
import threading
import time
from concurrent.futures import Future

import pytest

from rl_algorithms.agent_programs.config import AgentProgramConfig
from rl_algorithms.agent_programs.programs import _Stoppers, run_program_rollouts
from rl_algorithms.agent_programs.server import EndpointServer

from .test_agent_loop import RandomTokenGeneration
from .test_agent_programs import PROGRAMS, FinalAnswerEnv, prompts, roll


@pytest.fixture(scope="module")
def server():
    endpoint = EndpointServer()
    yield endpoint
    endpoint.close()


def test_a_stopped_rollout_kills_its_commands_at_once(server, tokenizer, template, tmp_path):
    # Async GRPO's collector stops a cancelled group's rollout this way (``stop``).

    pid_file, script = tmp_path / "pid", tmp_path / "hangs.py"
    script.write_text(
        # Written aside and renamed: the pid file exists only with the pid in it.
        f"import os, time\nopen({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid()))\n"
        f"os.replace({str(pid_file)!r} + '.tmp', {str(pid_file)!r})\ntime.sleep(300)\n"
    )
    stop: Future = Future()

    def stop_once_started():
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        stop.set_exception(RuntimeError("the group was cancelled"))

    threading.Thread(target=stop_once_started, daemon=True).start()
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="the group was cancelled"):
        run_program_rollouts(
            server,
            AgentProgramConfig(command=f"{sys.executable} {script}"),  # cut at 300 s
            RandomTokenGeneration(tokenizer),
            prompts(tokenizer, template, [{}]),
            tokenizer,
            template,
            {"task": FinalAnswerEnv()},
            max_seq_len=256,
            temperature=1.0,
            top_p=1.0,
            stop=stop,
        )
    assert time.monotonic() - began < 60  # not its 300 s deadline
    assert_ends(int(pid_file.read_text()))


def assert_ends(pid: int) -> None:
    """Fails unless process ``pid`` is gone (or a zombie: killed, not yet reaped by whoever
    adopted it) within 10 s."""

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return
        except (ProcessLookupError, FileNotFoundError):
            return
        time.sleep(0.05)
    raise AssertionError(f"the command's process {pid} is still running")


def test_an_async_program_cut_at_its_deadline_is_cancelled(server, tokenizer, template, tmp_path):
    report = tmp_path / "report"
    result = roll(
        server,
        RandomTokenGeneration(tokenizer),
        prompts(tokenizer, template, [{"report": str(report)}]),
        tokenizer,
        template,
        function=f"{PROGRAMS}:waits_until_cancelled",
        max_episode_seconds=2.0,
    )
    assert result.end_reasons == ["agent_failed/timeout"]
    deadline = time.monotonic() + 10
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert report.read_text() == "cancelled"  # its task, not left running for 120 s


def test_a_command_cut_at_its_deadline_is_killed_with_what_it_started(
    server, tokenizer, template, tmp_path
):
    # A shell that starts a child and waits: the child is killed too, not left to go on
    # calling the endpoint.
    pid_file = tmp_path / "pid"
    command = f"sh -c 'sleep 300 & echo $! > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; wait'"
    result = roll(
        server,
        RandomTokenGeneration(tokenizer),
        prompts(tokenizer, template, [{}]),
        tokenizer,
        template,
        command=command,
        max_episode_seconds=2.0,
    )
    assert result.end_reasons == ["agent_failed/timeout"]
    assert_ends(int(pid_file.read_text()))


def test_a_program_cut_before_it_could_hand_over_its_stopper_is_stopped_as_it_does():

    stoppers, stopped = _Stoppers(), []
    stoppers.register(0, lambda: stopped.append(0))
    stoppers.stop(1)  # cut while its program is still starting
    assert stopped == []
    stoppers.register(1, lambda: stopped.append(1))  # stopped at once
    stoppers.stop(0)
    assert stopped == [1, 0]
