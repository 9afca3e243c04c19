"""The trajectory collector with the agent loop, fast: the real collector (in process, no Ray
actor), the real agent loop and ``Episodes``, a real tokenizer and chat template, and an
in-process streaming engine standing in for vLLM (a test double for the engine only).

Shown: multi-turn episodes of very different lengths (1 or 10 turns) run through the
collector with refits between trainer steps, and every prompt started is trained on exactly
once (no requeue, no discarded work: no bias toward short episodes), each token tagged with
the weight version that sampled it; admission keeps generation within
``max_trajectory_age_steps`` of the trainer; dynamic sampling filters a group whose rewards are
all equal, counts it and does not generate its prompt again; a cancelled group leaves no
stream running on the engine. Groups played by agent programs are tested in
test_collector_agent_programs.py, with this file's engine and helpers.
"""

import itertools
import threading
import time
from collections import Counter
from concurrent.futures import wait as futures_wait

import pytest
import torch

from rl_algorithms.agent_loop import AgentLoopConfig
from rl_algorithms.grpo.async_loop import Trajectories
from rl_algorithms.grpo.collector import TrajectoryCollector
from rl_algorithms.grpo.collector_client import (
    HEARTBEAT_GRACE_SECONDS,
    CollectorError,
    check_reply,
)
from rl_algorithms.grpo.replay_buffer import ReplayBuffer
from rl_data.loader import StatefulDataLoader
from rl_data.messages import tokenize_message_logs
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn
from rl_models.generation.streaming import StreamingSampler, StreamNews

from .test_agent_loop import CancellableSleeper

G = 2
REPLIES = ("<action>right</action>", "<action>left</action>")  # row 0's, row 1's


class InProcessEngine:
    """A ``StreamingSampler`` in this process: row ``r`` of a stream answers ``REPLIES[r % 2]``
    and EOS ``seconds`` after its start (``hang``: never), tagged with the weight version at
    its start and at its end (``version``, which the test bumps as a refit). Records every
    stream started and cancelled."""

    name = "in-process engine"

    def __init__(self, tokenizer, seconds: float = 0.01, hang: bool = False) -> None:
        self.tokenizer, self.seconds, self.hang = tokenizer, seconds, hang
        self.version = 0
        self.lock = threading.Lock()
        self.streams: dict[str, tuple[BatchedDataDict, float, int]] = {}
        self.ids = itertools.count()
        self.cancelled: list[str] = []

    def start(self, data, greedy=False):
        with self.lock:
            stream_id = f"s{next(self.ids)}"
            self.streams[stream_id] = (data, time.monotonic(), self.version)
            return stream_id

    def _sample(self, data, row, version_min):
        reply = self.tokenizer.encode(REPLIES[row % 2], add_special_tokens=False)
        reply = torch.tensor([*reply, self.tokenizer.eos_token_id])
        n = int(data["input_lengths"][row])
        ids = torch.cat([data["input_ids"][row, :n], reply])[None]
        logprobs = torch.zeros(ids.shape)
        logprobs[0, n:] = -0.25
        return BatchedDataDict(
            output_ids=ids,
            generation_lengths=torch.tensor([len(reply)]),
            unpadded_sequence_lengths=torch.tensor([n + len(reply)]),
            logprobs=logprobs,
            truncated=torch.tensor([False]),
            weight_version_min=torch.tensor([version_min]),
            weight_version_max=torch.tensor([self.version]),
        )

    def poll(self, stream_ids, timeout=0.0):
        news = {}
        with self.lock:
            for stream_id in stream_ids:
                data, began, version = self.streams[stream_id]
                if self.hang or time.monotonic() - began < self.seconds:
                    continue
                rows = {r: self._sample(data, r, version) for r in range(data.size)}
                del self.streams[stream_id]
                news[stream_id] = StreamNews(rows, done=True)
        if not news:
            time.sleep(min(timeout, 0.005))
        return news

    def cancel(self, stream_id):
        with self.lock:
            self.cancelled.append(stream_id)
            stream = self.streams.pop(stream_id, None)
            return 0 if stream is None else stream[0].size

    def weight_version(self):
        return self.version


def test_the_in_process_engine_is_a_streaming_sampler(tokenizer):
    assert isinstance(InProcessEngine(tokenizer), StreamingSampler)


class TurnsEnv(EnvironmentInterface):
    """Each episode plays ``turns`` turns (its prompt's metadata), a ``role: tool`` reply
    after each but the last; it ends with reward 1 if its first turn said "right", or always
    with ``constant``. Serves concurrent steps."""

    concurrent_steps = True

    def step(self, message_log_batch, metadata):
        out = []
        for log, meta in zip(message_log_batch, metadata, strict=True):
            turn = meta["turn"] + 1
            done = turn >= meta["turns"]
            first = next(m for m in log if m["role"] == "assistant")  # (one stream: rows 0, 1)
            right = "right" in str(first["content"])
            reward = float(done and (meta.get("constant", False) or right))
            reply = [{"role": "tool", "content": "turn", "tool_call_id": str(turn)}]
            out.append((reply, {**meta, "turn": turn}, reward, done))
        return EnvironmentReturn(
            observations=[o[0] for o in out],
            metadata=[o[1] for o in out],
            next_stop_strings=[None] * len(out),
            rewards=torch.tensor([o[2] for o in out]),
            terminateds=torch.tensor([o[3] for o in out]),
            answers=[None] * len(out),
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


def collate(samples: list[dict]) -> BatchedDataDict:
    return BatchedDataDict(**{k: [s[k] for s in samples] for k in samples[0]})


def prompt_rows(tokenizer, template, metas: list[dict]) -> list[dict]:
    logs = [[{"role": "user", "content": f"[sample {i}] Solve this"}] for i in range(len(metas))]
    tokenize_message_logs(logs, tokenizer, template, add_generation_prompt=True)
    return [
        {"message_log": log, "extra_env_info": {"turn": 0, **m}, "task_name": "t", "idx": i}
        for i, (log, m) in enumerate(zip(logs, metas, strict=True))
    ]


class LocalClient:
    """The trainer's view of an in-process collector: ``CollectorClient``'s checks of each
    reply, without the Ray actor."""

    def __init__(self, collector: TrajectoryCollector) -> None:
        self.collector = collector

    def take(self, consumed, timeout=1.0, stale=None, lag=0):
        reply = self.collector.take(consumed, timeout, stale, lag)
        return check_reply(reply, self.describe(), HEARTBEAT_GRACE_SECONDS, lag)

    def describe(self):
        return "in-process collector"


def collector(tokenizer, template, engine, metas, **kwargs) -> TrajectoryCollector:
    rows = prompt_rows(tokenizer, template, metas)
    loader = StatefulDataLoader(rows, min(4, len(rows)), collate, shuffle=False)
    return TrajectoryCollector(
        [engine],
        tokenizer.pad_token_id,
        tokenizer,
        template,
        kwargs.pop("envs", {"t": TurnsEnv()}),
        loader,
        group_size=G,
        max_seq_len=1024,
        max_epochs=1,
        max_group_seconds=kwargs.pop("max_group_seconds", 60.0),
        max_groups_ahead=kwargs.pop("max_groups_ahead", 100),
        prompts_per_step=kwargs.pop("prompts_per_step", 2),
        max_age_steps=kwargs.pop("max_age_steps", 1),
        in_flight_weight_updates=True,
        max_turns=10,
        agent_loop=kwargs.pop("agent_loop", AgentLoopConfig()),
        **kwargs,
    )


def train(
    client: TrajectoryCollector,
    engine: InProcessEngine,
    n: int,
    steps: int,
    span: int,
    train_seconds: float = 0.02,
):
    """Take ``n`` groups a step for ``steps`` steps, each trained for ``train_seconds``,
    bumping the engine's weights after each (an in-flight refit). Returns the groups of each
    step, the buffer, the collector's last reply (it must have run out of prompts, nothing
    left running), counts (the most groups out at once, the steps that waited for a long
    group) and the age of every sample trained on (its step minus that of the oldest weights
    it saw)."""
    buffer = ReplayBuffer(span)
    trajectories = Trajectories(buffer, LocalClient(client), max_wait=60)
    taken, most_out, ages = [], 0, []
    buffer.record_step(0, 0)
    for step in range(steps):
        groups, _ = trajectories.take(n, step)
        taken.append(groups)
        ages += [age for g in groups for age in buffer.ages(g, step).tolist()]
        most_out = max(most_out, client.out + len(groups))
        time.sleep(train_seconds)  # the train step
        engine.version += 1
        buffer.record_step(step + 1, engine.version)
    trajectories.lag = 0  # waiting for the next step's groups, which never come
    deadline = time.monotonic() + 10
    with pytest.raises(CollectorError, match="ran out of prompts"):  # once its groups end
        while time.monotonic() < deadline:
            trajectories.pull(timeout=0.5)
    last = client.take(trajectories.consumed, 0.0)  # its counters now
    counts = {"most_out": most_out, "straggler_waits": trajectories.straggler_waits}
    return taken, buffer, last, counts, ages


# Every third prompt's episodes take 10 turns, the others' one.
LONG_TAIL = [{"turns": 10 if i % 3 == 0 else 1, "constant": True} for i in range(24)]


def test_episodes_ten_times_longer_are_trained_on_as_often_as_they_are_sampled(tokenizer, template):
    # Every third prompt's episodes take 10 turns, the others' one.
    metas = LONG_TAIL
    engine = InProcessEngine(tokenizer)
    client = collector(tokenizer, template, engine, metas)
    try:
        steps, buffer, reply, counts, ages = train(client, engine, n=2, steps=12, span=4)
    finally:
        client.stop()
    trained = Counter(int(g.prompt["idx"][0]) for groups in steps for g in groups)
    assert trained == Counter(range(24))  # every prompt sampled is trained on, once
    assert reply.requeued_groups == reply.aborted_groups == reply.stale_requeued_groups == 0
    assert buffer.dropped_groups == 0 and reply.discarded_tokens == 0
    assert reply.generated_tokens > 0
    # Admission: never more groups out than two steps' worth (max age 1).
    assert counts["most_out"] <= 2 * 2
    # A 10-turn group overtaken by one-turn groups is trained later, older than max age 1,
    # but within the span (none was dropped).
    assert max(ages) <= 4 and max(ages) > 1
    groups = [g for s in steps for g in s]
    long = [g for g in groups if int(g.prompt["idx"][0]) % 3 == 0]
    assert all(int(g.result.turns.min()) == 10 for g in long)
    # A 10-turn episode saw refits: its turns carry several versions, token by token.
    assert any(int((g.version_max - g.version_min).max()) > 0 for g in long)
    for g in groups:
        for log, vmin in zip(g.result.message_logs, g.version_min.tolist(), strict=True):
            tags = [m["generation_versions"] for m in log if "generation_versions" in m]
            flat = torch.cat(tags)
            assert int(flat.min()) == vmin
            assert bool((flat[1:] >= flat[:-1]).all())  # later turns, newer weights
    batch = groups[0].result.training_batch(tokenizer.pad_token_id)
    versions = batch.extras["generation_versions"]  # beside generation_logprobs
    assert bool((versions[batch.loss_mask > 0] >= 0).all())  # every sampled token has one
    assert bool((versions[:, 0] == -1).all())  # a prompt token has none


def test_a_long_group_at_the_span_is_waited_for_not_dropped(tokenizer, template):
    # The same long-tail workload with a span of 2: a 10-turn group outlives two steps of
    # one-turn groups (the test above sees ages up to 4), so without the trainer waiting for
    # it at its last chance it would be dropped as too old, generated again and dropped again.
    metas = LONG_TAIL
    engine = InProcessEngine(tokenizer)
    client = collector(tokenizer, template, engine, metas)
    try:
        steps, buffer, reply, counts, ages = train(client, engine, n=2, steps=12, span=2)
    finally:
        client.stop()
    trained = Counter(int(g.prompt["idx"][0]) for groups in steps for g in groups)
    assert trained == Counter(range(24))  # long and short alike, each once
    assert buffer.dropped_groups == 0 and reply.stale_requeued_groups == 0
    assert reply.discarded_tokens == 0
    assert max(ages) == 2  # the span is reached, never passed
    assert counts["straggler_waits"] > 0  # some step did wait for a long group


def test_dynamic_sampling_filters_groups_without_signal_and_does_not_requeue_them(
    tokenizer, template
):
    # Odd prompts always earn 1 (no signal); even ones 1 for row 0's "right", 0 for "left".
    metas = [{"turns": 2, "constant": i % 2 == 1} for i in range(8)]
    engine = InProcessEngine(tokenizer)
    client = collector(tokenizer, template, engine, metas, dynamic_sampling=True)
    try:
        steps, _, reply, _, _ = train(client, engine, n=2, steps=2, span=4)
    finally:
        client.stop()
    trained = sorted(int(g.prompt["idx"][0]) for s in steps for g in s)
    assert trained == [0, 2, 4, 6]
    assert reply.filtered_groups == 4  # counted, and run out of prompts: never requeued
    for s in steps:
        for g in s:
            assert sorted(g.result.rewards.tolist()) == [0.0, 1.0]


def test_a_group_past_its_deadline_is_cancelled_and_leaves_no_stream(tokenizer, template):
    engine = InProcessEngine(tokenizer, hang=True)
    client = collector(
        tokenizer, template, engine, [{"turns": 3}] * 4, max_group_seconds=0.3, max_groups_ahead=1
    )
    try:
        deadline = time.monotonic() + 10
        while client.requeued < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.requeued >= 2  # cancelled, its prompt queued again, cancelled again
        assert len(engine.cancelled) >= 2
    finally:
        client.stop()
    assert engine.streams == {}  # nothing left running on the engine
    assert client.requests_in_flight() == {"waiting": 0, "running": 0}


def test_stopping_the_collector_ends_the_turns_it_was_generating(tokenizer, template):
    # Turns that never finish on their own: stop() must fail them, or their agent loops'
    # threads wait forever (and hold up the interpreter's exit).
    engine = InProcessEngine(tokenizer, hang=True)
    client = collector(tokenizer, template, engine, [{"turns": 3}] * 2)
    deadline = time.monotonic() + 10
    while len(client.turns.running) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(client.turns.running) == 2  # both groups' first turns are on the engine
    groups = list(client.groups)
    client.stop()
    finished, _ = futures_wait([g.play for g in groups], timeout=10)
    assert len(finished) == 2
    assert engine.streams == {}


def test_admission_keeps_groups_that_finish_in_order_within_the_max_age(tokenizer, template):
    # Episodes that finish in the order they started: none trained is older than
    # max_age_steps (1), though the buffer would keep them up to a span of 4. Admission only
    # bounds the age of groups that finish in order, and one step's groups start only about
    # a train step before the next step's (those start once the trainer, done training,
    # waits for its next groups). A train step of 0.1 s keeps the threads' jitter from
    # reordering them; at 0.02 s a group once finished after the next step's and was trained
    # two steps old. Episodes of 0.2 s keep the trainer waiting, so a collector that ignored
    # the trainer's lag would admit a step early and fail this.
    metas = [{"turns": 1, "constant": True} for _ in range(16)]
    engine = InProcessEngine(tokenizer, seconds=0.2)
    client = collector(tokenizer, template, engine, metas, max_age_steps=1)
    try:
        _, _, _, _, ages = train(client, engine, n=2, steps=8, span=4, train_seconds=0.1)
    finally:
        client.stop()
    assert len(ages) == 16 * G
    assert max(ages) == 1  # the bound is reached, never passed


def validate_while_generating(client: TrajectoryCollector, seconds: float) -> None:
    """Once a turn is generating, pause the collector as validation does (a scoring drain)
    for ``seconds``, then resume it."""
    deadline = time.monotonic() + 10
    while not client.turns.running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert client.drain(5.0, scoring=True)
    time.sleep(seconds)
    client.resume()


def test_time_held_at_the_gate_counts_against_no_deadline(tokenizer, template):
    """Validation (a scoring drain) holds a group's environment step for longer than both
    ``env_step_timeout_s`` and ``max_group_seconds``: after ``resume`` the step runs, the
    episodes end as they should, and the group is neither cut nor cancelled."""
    engine = InProcessEngine(tokenizer, seconds=0.05)
    # Deadlines of a second or two, not tenths: two turns of 0.05 s must fit in them with
    # room for a busy machine's thread jitter.
    loop = AgentLoopConfig(env_step_timeout_s=1.0)
    client = collector(
        tokenizer, template, engine, [{"turns": 2}] * 2, max_group_seconds=2.0, agent_loop=loop
    )
    try:
        validate_while_generating(client, seconds=2.5)  # its first turn done, its step held
        groups, _, reply, _, _ = train(client, engine, n=1, steps=2, span=4)
    finally:
        client.stop()
    assert reply.requeued_groups == 0
    for [group] in groups:
        assert group.result.end_reasons == ["terminated"] * G
        assert group.seconds < 2.0  # its age leaves the drain out


class HangingEnv(TurnsEnv):
    """``TurnsEnv`` whose first ``hangs`` steps block (``hung`` set) until ``release`` is set."""

    def __init__(self, hangs: int) -> None:
        self.hangs, self.calls = hangs, itertools.count()
        self.hung, self.release = threading.Event(), threading.Event()

    def step(self, message_log_batch, metadata):
        if next(self.calls) < self.hangs:
            self.hung.set()
            self.release.wait()
        return super().step(message_log_batch, metadata)


def test_a_step_that_hangs_past_its_deadline_does_not_stall_validation(tokenizer, template):
    # An in-process step cannot be cancelled: it keeps its thread, but past its deadline it is
    # no longer waited for by a scoring drain.
    env = HangingEnv(hangs=1)
    engine = InProcessEngine(tokenizer)
    loop = AgentLoopConfig(env_step_timeout_s=0.3, env_steps="batched")
    client = collector(
        tokenizer,
        template,
        engine,
        [{"turns": 2}],
        envs={"t": env},
        agent_loop=loop,
    )
    try:
        assert env.hung.wait(10)
        began = time.monotonic()
        assert client.drain(5.0, scoring=True)
        assert time.monotonic() - began < 2.0
        client.resume()
        [[group]], _, _, _, _ = train(client, engine, n=1, steps=1, span=4)
        assert group.result.end_reasons == ["env_timeout"] * G
    finally:
        env.release.set()
        client.stop()


def test_groups_stuck_in_a_step_hold_no_thread_later_groups_need(tokenizer, template):
    # No env_step_timeout_s: five groups in turn hang in their step until cancelled past
    # max_group_seconds, each keeping its thread (more than a pool's worth); the prompt they
    # retried still gets played, and the stuck ones are reported.
    env = HangingEnv(hangs=5)
    engine = InProcessEngine(tokenizer)
    client = collector(
        tokenizer,
        template,
        engine,
        [{"turns": 1, "constant": True}],
        envs={"t": env},
        max_group_seconds=1.0,  # the sixth, good attempt must fit in it, on a busy machine too
        max_groups_ahead=1,
        agent_loop=AgentLoopConfig(env_steps="batched"),
    )
    try:
        [[group]], _, reply, _, _ = train(client, engine, n=1, steps=1, span=4)
        assert group.result.end_reasons == ["terminated"] * G
        assert reply.requeued_groups == 5 and reply.stuck_groups == 5
    finally:
        env.release.set()
        client.stop()


@pytest.mark.ray
def test_a_late_step_on_an_actor_is_cancelled_through_the_gate(ray_session, tokenizer, template):
    # The collector passes every step through its gate; the agent loop still sends an actor's
    # step itself, so the step cut at env_step_timeout_s is cancelled on the actor.
    import ray

    actor = ray.remote(CancellableSleeper).options(num_cpus=0).remote(seconds=5.0)
    assert ray.get(actor.record.remote()) == (0, 0)  # started, before its first step
    engine = InProcessEngine(tokenizer)
    loop = AgentLoopConfig(env_step_timeout_s=0.5, env_steps="batched")
    client = collector(
        tokenizer, template, engine, [{"turns": 1}], envs={"t": actor}, agent_loop=loop
    )
    try:
        [[group]], _, _, _, _ = train(client, engine, n=1, steps=1, span=4)
        assert group.result.end_reasons == ["env_timeout"] * G
        started, stopped_early = ray.get(actor.record.remote(), timeout=30)
    finally:
        client.stop()
        ray.kill(actor)
    assert (started, stopped_early) == (1, 1)
