"""The trajectory collector's bookkeeping, fast: a real collector actor, real Ray, the real
sliding-puzzle environment, and a scripted engine standing in for the vLLM worker (a test
double for the engine only; the real async engine runs in ``functional/test_async_grpo.py``).

Shown: every prompt comes back as a scored group tagged with its weight versions; a group whose
generation never finishes is cancelled on the engine and its prompt generated again; so is one
vLLM aborted on its own, and one the trainer dropped as too stale (as often as it takes: no
requeue limit stops a run); a prompt too long to generate from carries the
engine's weight version; running out of prompts, a killed collector and a wedged engine each
raise in the trainer, naming the collector (and the engine), instead of leaving it waiting; a
drain lets no generation start until the refit after it ends; a checkpoint holds every prompt
drawn but not yet handed over; agent programs play their groups through the endpoint the
collector actor serves, and a hung one's group is cut and generated again.
"""

import re
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from rl_algorithms.agent_programs.config import AgentProgramConfig
from rl_algorithms.grpo.async_loop import Trajectories
from rl_algorithms.grpo.collector_client import CollectorClient, CollectorError
from rl_algorithms.grpo.replay_buffer import ReplayBuffer
from rl_data.loader import StatefulDataLoader
from rl_data.messages import tokenize_message_logs
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.worker_types import WorkerFutures, WorkerTimeoutError
from rl_envs.sliding_puzzle import SlidingPuzzleConfig, SlidingPuzzleEnvironment, first_prompt
from rl_models.generation import RequestAbortedError
from rl_models.generation.streaming import StreamingSampler, StreamNews

# Each test starts actors that import torch: ~30 s apiece on the busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

G = 2
BOARD = {"board": [[1, 2, 3], [4, 5, 6], [7, 0, 8]], "turn": 0}  # "right" solves it


class ScriptedEngine:
    """Answers every row with ``<action>right</action>`` and EOS at weight version 3, except
    that with ``hang_first`` the first stream never finishes, with ``abort_first`` vLLM aborts
    it, and with ``wedged`` every poll blocks for an hour; ``start_seconds`` makes each
    ``start_stream`` take that long. Records the streams cancelled and when each start ran."""

    def __init__(
        self, tokenizer, hang_first: bool, abort_first=False, wedged=False, start_seconds=0.0
    ) -> None:
        self.tokenizer, self.hang_first, self.abort_first = tokenizer, hang_first, abort_first
        self.wedged, self.start_seconds = wedged, start_seconds
        self.streams: dict[str, tuple[BatchedDataDict, bool]] = {}
        self.held_back: dict[str, list] = {}  # the second half of a stream's samples
        self.started = 0
        self.cancelled: list[str] = []
        self.starts: list[tuple[float, float]] = []  # (began, ended), time.time()
        self.first_prompt = ""  # the text stream s0 was started with

    def get_weight_version(self):
        return 3

    def start(self, data, greedy=False):
        began = time.time()
        time.sleep(self.start_seconds)
        stream_id = f"s{self.started}"
        if self.started == 0:
            n = int(data["input_lengths"][0])
            self.first_prompt = self.tokenizer.decode(data["input_ids"][0, :n])
        self.streams[stream_id] = (data, self.hang_first and self.started == 0)
        self.started += 1
        self.starts.append((began, time.time()))
        return stream_id

    def get_starts(self):
        return self.starts

    def get_first_prompt(self):
        return self.first_prompt

    def next_finished(self, stream_id, timeout=None):
        if self.wedged:
            time.sleep(3600)
        data, hangs = self.streams[stream_id]
        if self.abort_first and stream_id == "s0":
            del self.streams[stream_id]
            raise RequestAbortedError(f"{stream_id}-0", 0)
        if hangs:
            return [], False
        del self.streams[stream_id]
        reply = [*self.tokenizer.encode("<action>right</action>", add_special_tokens=False)]
        reply.append(self.tokenizer.eos_token_id)
        out = []
        for row in range(data.size):
            n = int(data["input_lengths"][row])
            ids = torch.cat([data["input_ids"][row, :n], torch.tensor(reply)])[None]
            logprobs = torch.zeros(ids.shape, dtype=torch.float32)
            logprobs[0, n:] = -0.5
            sample = BatchedDataDict(
                output_ids=ids,
                generation_lengths=torch.tensor([len(reply)]),
                unpadded_sequence_lengths=torch.tensor([n + len(reply)]),
                logprobs=logprobs,
                truncated=torch.tensor([False]),
                weight_version_min=torch.tensor([3]),
                weight_version_max=torch.tensor([3]),
            )
            out.append((row, sample))
        return out, True

    def poll(self, stream_ids, timeout=0.0):
        """As the vLLM worker's: news of every stream that has some, waiting when none has.
        A stream's samples come in two polls (the first half, then the rest), as a real
        engine's finish over several."""
        news = {}
        for stream_id in stream_ids:
            if stream_id in self.held_back:
                news[stream_id] = StreamNews(dict(self.held_back.pop(stream_id)), True)
                continue
            try:
                ready, done = self.next_finished(stream_id)
            except RequestAbortedError as err:
                news[stream_id] = StreamNews({}, False, aborted=err)
                continue
            if done and len(ready) > 1:
                half = len(ready) // 2
                ready, self.held_back[stream_id], done = ready[:half], ready[half:], False
            if ready or done:
                news[stream_id] = StreamNews(dict(ready), done)
        if not news:
            time.sleep(timeout)
        return news

    def weight_version(self):
        return self.get_weight_version()

    def cancel(self, stream_id):
        self.cancelled.append(stream_id)
        self.streams.pop(stream_id, None)
        self.held_back.pop(stream_id, None)
        return G

    def get_cancelled(self):
        return self.cancelled


class ScriptedSampler:
    """The collector's view of the scripted engine (a Ray actor), through the same typed
    interface as vLLM's sampler, each call with its deadline."""

    name = "scripted engine 0"

    def __init__(self, engine, call_timeout: float) -> None:
        self.engine, self.call_timeout = engine, call_timeout

    def _call(self, method, *args):
        try:
            return ray.get(getattr(self.engine, method).remote(*args), timeout=self.call_timeout)
        except ray.exceptions.GetTimeoutError as err:
            raise WorkerTimeoutError(
                f"{self.name} did not answer {method!r} within {self.call_timeout:.0f} s",
                [0],
                WorkerFutures([], [0], method),
            ) from err

    def start(self, data, greedy=False):
        return self._call("start", data, greedy)

    def poll(self, stream_ids, timeout=0.0):
        return self._call("poll", stream_ids, timeout)

    def cancel(self, stream_id):
        return self._call("cancel", stream_id)

    def weight_version(self):
        return self._call("weight_version")


def test_the_scripted_sampler_is_a_streaming_sampler():
    assert isinstance(ScriptedSampler(None, 1.0), StreamingSampler)


def collate(samples: list[dict]) -> BatchedDataDict:
    return BatchedDataDict(
        message_log=[s["message_log"] for s in samples],
        extra_env_info=[s["extra_env_info"] for s in samples],
        task_name=[s["task_name"] for s in samples],
        idx=[s["idx"] for s in samples],
    )


def prompts(tokenizer, template, n: int, long_idx: int | None = None) -> list[dict]:
    logs = [
        [{"role": "user", "content": f"{i}: {first_prompt(BOARD) * (20 if i == long_idx else 1)}"}]
        for i in range(n)
    ]
    tokenize_message_logs(logs, tokenizer, template, add_generation_prompt=True)
    return [
        {"message_log": log, "extra_env_info": dict(BOARD), "task_name": "sliding_puzzle", "idx": i}
        for i, log in enumerate(logs)
    ]


def start(tokenizer, template, n_prompts: int, hang_first: bool, name: str, **kwargs):
    engine_options = {
        k: kwargs.pop(k) for k in ("abort_first", "wedged", "start_seconds") if k in kwargs
    }
    engine = (
        ray.remote(ScriptedEngine)
        .options(num_cpus=0)
        .remote(tokenizer, hang_first, **engine_options)
    )
    data = prompts(tokenizer, template, n_prompts, kwargs.pop("long_idx", None))
    loader = StatefulDataLoader(data, 2, collate, shuffle=False)
    if "loader_state" in kwargs:  # a resumed run's loader
        loader.load_state_dict(kwargs.pop("loader_state"))
    sampler = ScriptedSampler(engine, kwargs.get("engine_call_seconds", 300.0))
    envs = kwargs.pop("envs", None) or {
        "sliding_puzzle": SlidingPuzzleEnvironment(SlidingPuzzleConfig())
    }
    client = CollectorClient(
        name,
        [sampler],
        tokenizer.pad_token_id,
        tokenizer,
        template,
        envs,
        loader,
        group_size=G,
        max_seq_len=512,
        max_epochs=1,
        max_group_seconds=kwargs.pop("max_group_seconds", 60.0),
        max_groups_ahead=kwargs.pop("max_groups_ahead", 4),
        prompts_per_step=kwargs.pop("prompts_per_step", 2),
        max_age_steps=kwargs.pop("max_age_steps", 4),
        in_flight_weight_updates=True,
        **kwargs,
    )
    return client, engine


def test_a_hung_generation_is_requeued_then_every_prompt_scored_then_running_out_raises(
    tokenizer, template
):
    client, engine = start(
        tokenizer, template, 4, hang_first=True, name="collector-hang", max_group_seconds=10.0
    )
    groups, consumed = [], 0
    try:
        with pytest.raises(CollectorError, match=r"collector-hang.*ran out of prompts"):
            for _ in range(200):
                reply = client.take(consumed, timeout=0.5)
                groups += reply.groups
                consumed += len(reply.groups)
    finally:
        client.stop()
    assert ray.get(engine.get_cancelled.remote()) == ["s0"]
    assert reply.requeued_groups == 1
    # The hung prompt (the first one) came back through a new stream: all four are there.
    assert sorted(g.prompt["idx"][0] for g in groups) == [0, 1, 2, 3]
    for g in groups:
        assert g.result.rewards.tolist() == [1.0] * G  # "right" solves the board
        assert g.version_min.tolist() == g.version_max.tolist() == [3] * G
        assert g.result.message_logs[0][-1]["generation_logprobs"].eq(-0.5).any()


def test_a_killed_collector_is_reported_by_name_within_seconds(tokenizer, template):
    client, _ = start(tokenizer, template, 4, hang_first=True, name="collector-killed")
    client.take(0, timeout=0.5)
    ray.kill(client.actor)
    start_time = time.monotonic()
    with pytest.raises(CollectorError, match=r"collector-killed.*died"):
        for _ in range(100):
            client.take(0, timeout=0.5)
    assert time.monotonic() - start_time < 30  # not a hang


def test_checkpoint_state_holds_every_prompt_drawn_and_not_handed_over(tokenizer, template):
    # The first group hangs (max_group_seconds is long): it stays drawn, never finished.
    client, _ = start(tokenizer, template, 8, hang_first=True, name="collector-state")
    try:
        taken = []
        deadline = time.monotonic() + 30
        while len(taken) < 3 and time.monotonic() < deadline:
            taken += client.take(len(taken), timeout=0.5).groups
        state = client.state_dict()
    finally:
        client.stop()
    pending = [p["idx"][0] for p in state["pending_prompts"]]
    handed = [g.prompt["idx"][0] for g in taken]
    # Drawn from the loader so far = handed over + pending, with nothing lost or doubled.
    drawn = state["loader"]["position"] * 2
    assert sorted(handed + pending) == list(range(drawn))
    assert pending  # the hung group's prompt (the first stream started) goes to the checkpoint


def take_all(client, consumed: int = 0) -> tuple[list, dict]:
    """Every group until the collector runs out of prompts, and its last reply. ``consumed``:
    groups the trainer had already used when it started taking (a resumed buffer's)."""
    groups, reply = [], None
    with pytest.raises(CollectorError, match=r"ran out of prompts"):
        for _ in range(200):
            reply = client.take(consumed, timeout=0.5)
            groups += reply.groups
            consumed += len(reply.groups)
    return groups, reply


def test_an_aborted_group_is_requeued_and_a_too_long_prompt_has_the_engines_version(
    tokenizer, template
):
    client, engine = start(
        tokenizer, template, 4, hang_first=False, abort_first=True, long_idx=3, name="c-abort"
    )
    try:
        groups, reply = take_all(client)
    finally:
        client.stop()
    assert reply.aborted_groups == 1 and reply.requeued_groups == 0
    assert sorted(g.prompt["idx"][0] for g in groups) == [0, 1, 2, 3]
    # Each group's agent loop runs on a thread of its own, so which prompt the first stream
    # (the aborted one) carried is a race: read it from the engine.
    first = re.search(r"(\d+): Solve", ray.get(engine.get_first_prompt.remote()))
    assert first is not None
    aborted_idx = int(first.group(1))
    (again,) = [g for g in groups if g.prompt["idx"][0] == aborted_idx]
    assert again.requeues == 1 and again.result.rewards.tolist() == [1.0] * G
    assert sorted(g.requeues for g in groups) == [0, 0, 0, 1]
    (long,) = [g for g in groups if g.prompt["idx"][0] == 3]
    assert bool(long.result.truncated.all())  # scored without generating
    # Tagged with the weights the engine held, not version 0 (which would read as ancient).
    assert long.version_min.tolist() == long.version_max.tolist() == [3] * G


def test_stale_groups_are_generated_again_and_no_requeue_limit_stops_the_run(tokenizer, template):
    client, _ = start(tokenizer, template, 4, hang_first=False, name="c-stale")
    buffer = ReplayBuffer(max_age_steps=0)
    trajectories = Trajectories(buffer, client, max_wait=60)
    try:
        buffer.record_step(0, 3)  # the engine's version 3 is step 0's
        groups, _ = trajectories.take(2, step=0)
        assert [g.requeues for g in groups] == [0, 0]
        # The trainer moves on to version 4; the engine never changes: every group it makes
        # from now on is a step old, dropped, and its prompt generated again. The trainer
        # waits for young groups (none come) until max_wait; the collector never gives up.
        buffer.record_step(1, 4)
        trajectories.max_wait = 5
        with pytest.raises(CollectorError, match=r"waited \d+ s .*max_wait_seconds"):
            trajectories.take(2, step=1)
    finally:
        client.stop()
    reply = trajectories.last_reply
    assert reply.stale_requeued_groups >= 3 and buffer.dropped_groups >= 3
    assert buffer.dropped_tokens > 0  # their work is counted as discarded


def test_a_wedged_engine_is_reported_by_name_within_seconds(tokenizer, template):
    client, engine = start(
        tokenizer,
        template,
        4,
        hang_first=False,
        wedged=True,
        name="c-wedged",
        engine_call_seconds=2.0,
    )
    began = time.monotonic()
    try:
        with pytest.raises(
            CollectorError,
            match=r"c-wedged.*scripted engine 0 did not answer 'poll' within 2 s",
        ):
            for _ in range(100):
                client.take(0, timeout=0.5)
    finally:
        client.stop()
        ray.kill(engine)
    assert time.monotonic() - began < 30  # not a hang


def test_no_generation_starts_between_a_drain_and_the_resume_after_it(tokenizer, template):
    # One group out at a time: while the next one is being submitted none is generating, the
    # moment a drain that only looked at running groups would wrongly call drained.
    client, engine = start(
        tokenizer,
        template,
        16,
        hang_first=False,
        start_seconds=0.5,
        name="c-drain",
        max_groups_ahead=1,
    )
    try:
        consumed, deadline = 0, time.monotonic() + 1.5
        while time.monotonic() < deadline:  # keep it submitting
            consumed += len(client.take(consumed, timeout=0.2).groups)
        assert client.drain(10.0)
        drained = time.time()
        time.sleep(1.0)  # the refit
        resumed = time.time()
        client.resume()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # and take what it makes, so it goes on
            consumed += len(client.take(consumed, timeout=0.2).groups)
        starts = ray.get(engine.get_starts.remote())
    finally:
        client.stop()
    assert any(began >= resumed for began, _ in starts)  # it went on after the resume
    inside = [(b, e) for b, e in starts if e > drained and b < resumed]
    assert not inside, f"submissions ran during the refit: {inside} (window {drained}-{resumed})"


class SlowScoringPuzzle(SlidingPuzzleEnvironment):
    """Scores as the puzzle does, a second per call, and records when each call ran."""

    def __init__(self) -> None:
        super().__init__(SlidingPuzzleConfig())
        self.calls: list[tuple[float, float]] = []

    def step(self, message_log_batch, metadata):
        began = time.time()
        time.sleep(1.0)
        out = super().step(message_log_batch, metadata)
        self.calls.append((began, time.time()))
        return out

    def get_calls(self):
        return self.calls


def test_a_drain_with_scoring_leaves_no_environment_call_running_until_the_resume(
    tokenizer, template
):
    # Validation pauses the collector this way: an environment call while validation runs
    # would add a training group to validation's environment counts.
    env = ray.remote(SlowScoringPuzzle).options(num_cpus=0).remote()
    client, _engine = start(
        tokenizer,
        template,
        16,
        hang_first=False,
        name="c-drain-scoring",
        envs={"sliding_puzzle": env},
    )
    try:
        time.sleep(1.5)  # groups generate quickly and queue for the slow scorer
        assert client.drain(30.0, scoring=True)
        drained = time.time()
        time.sleep(1.5)  # validation
        resumed = time.time()
        client.resume()
        calls = ray.get(env.get_calls.remote())
    finally:
        client.stop()
    inside = [(b, e) for b, e in calls if e > drained and b < resumed]
    assert not inside, f"scoring ran while drained: {inside} (window {drained}-{resumed})"


def test_a_resume_keeps_the_buffer_and_every_prompt_and_regenerates_what_was_in_flight(
    tokenizer, template
):
    """What ``async_loop``'s docstring says a resume preserves, through the trainer's own
    ``Trajectories``: the saved buffer's groups come back with their step tags; the prompt
    that was generating at the checkpoint (its stream hangs) is generated again on the resumed
    run's engine; and over both runs every prompt is trained on exactly once."""
    client, _ = start(tokenizer, template, 8, hang_first=True, name="c-before", max_groups_ahead=6)
    buffer = ReplayBuffer(max_age_steps=4)
    trajectories = Trajectories(buffer, client, max_wait=60)
    try:
        buffer.record_step(0, 3)  # the engine's version 3 is step 0's
        trained, _ = trajectories.take(2, step=0)
        deadline = time.monotonic() + 30
        while len(buffer) < 2 and time.monotonic() < deadline:  # finished, not yet trained on
            trajectories.pull(timeout=0.5)
        state = trajectories.state_dict()  # what end_step saves in the checkpoint
    finally:
        client.stop()
    saved = [(g.prompt["idx"][0], g.step_min.tolist()) for g in state["buffer"]["groups"]]
    pending = [p["idx"][0] for p in state["collector"]["pending_prompts"]]
    # The first stream started hangs: its prompt was generating, its samples are lost.
    assert len(saved) >= 2 and len(pending) >= 1

    resumed_buffer = ReplayBuffer(max_age_steps=4)
    resumed_buffer.load_state_dict(state["buffer"])
    resumed_buffer.record_step(1, 5)  # the resumed policy goes on from its saved version
    client, _ = start(
        tokenizer,
        template,
        8,
        hang_first=False,
        name="c-after",
        max_groups_ahead=6,  # a resume keeps its config
        loader_state=state["collector"]["loader"],
        pending_prompts=state["collector"]["pending_prompts"],
        groups_out=len(resumed_buffer),
    )
    try:
        restored = [(g.prompt["idx"][0], g.step_min.tolist()) for g in resumed_buffer.groups]
        assert restored == saved  # the same groups, still tagged with the step that made them
        # The trainer trains on the restored groups first; until it says so they count as
        # out, and as many as ``max_groups_ahead`` of them would hold the collector back.
        after, _ = take_all(client, consumed=len(resumed_buffer))
    finally:
        client.stop()
    # The pending prompts are generated again, the hung one among them (this engine answers).
    # (They are admitted first; each group's agent loop runs in its own thread, so the order
    # in which groups finish is not the order they were admitted in.)
    assert set(pending) <= {g.prompt["idx"][0] for g in after}
    used = [g.prompt["idx"][0] for g in trained] + [i for i, _ in saved]
    used += [g.prompt["idx"][0] for g in after]
    assert sorted(used) == list(range(8))  # none lost, none doubled


def test_agent_programs_play_in_the_collector_actor_and_a_hung_group_is_requeued(
    tokenizer, template
):
    # The program's first request goes into the first stream, which hangs. (A good group takes
    # a second or two; 15 s leaves room for a machine under load, as the 10 s of the hung
    # generation test above does.)
    talk = f"{Path(__file__).with_name('agent_program_examples.py')}:talk"
    program = AgentProgramConfig(function=talk)
    client, engine = start(
        tokenizer,
        template,
        4,
        hang_first=True,
        name="c-programs",
        max_group_seconds=15.0,
        agent_program=program,
        sampling=(1.0, 1.0),
    )
    try:
        groups, reply = take_all(client)
    finally:
        client.stop()
    assert ray.get(engine.get_cancelled.remote()) == ["s0"] and reply.requeued_groups == 1
    assert sorted(g.prompt["idx"][0] for g in groups) == [0, 1, 2, 3]
    assert sorted(g.requeues for g in groups) == [0, 0, 0, 1]
    reply_ids = [*tokenizer.encode("<action>right</action>", add_special_tokens=False)]
    reply_ids.append(tokenizer.eos_token_id)
    for g in groups:
        assert g.result.end_reasons == ["agent_returned"] * G
        assert g.version_min.tolist() == g.version_max.tolist() == [3] * G
        for log in g.result.message_logs:  # the program's two turns, as the engine sampled them
            turns = [m for m in log if "token_loss_mask" in m]
            trained = [m["token_ids"][m["token_loss_mask"].bool()].tolist() for m in turns]
            assert trained == [reply_ids, reply_ids]
            assert all(bool(m["generation_versions"].eq(3).all()) for m in turns)
