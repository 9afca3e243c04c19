"""The trajectory collector's bookkeeping, fast: a real collector actor, real Ray, the real
sliding-puzzle environment, and a scripted engine standing in for the vLLM worker (a test
double for the engine only; the real async engine runs in ``functional/test_async_grpo.py``).

Shown: every prompt comes back as a scored group tagged with its weight versions; a group whose
generation never finishes is cancelled on the engine and its prompt generated again; running
out of prompts and a killed collector each raise in the trainer, naming the collector, instead
of leaving it waiting; a checkpoint holds every prompt drawn but not yet handed over.
"""

import sys
import time

import pytest
import ray
import torch

from rl_algorithms.trajectory_collector import CollectorClient, CollectorError
from rl_data.loader import StatefulDataLoader
from rl_data.messages import tokenize_message_logs
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.sliding_puzzle import SlidingPuzzleConfig, SlidingPuzzleEnvironment, first_prompt

# Each test starts actors that import torch: ~30 s apiece on the busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

G = 2
BOARD = {"board": [[1, 2, 3], [4, 5, 6], [7, 0, 8]], "turn": 0}  # "right" solves it


class ScriptedEngine:
    """Answers every row with ``<action>right</action>`` and EOS at weight version 3, except
    that with ``hang_first`` the first stream never finishes; records the streams cancelled."""

    def __init__(self, tokenizer, hang_first: bool) -> None:
        self.tokenizer, self.hang_first = tokenizer, hang_first
        self.streams: dict[str, tuple[BatchedDataDict, bool]] = {}
        self.started = 0
        self.cancelled: list[str] = []

    def execute(self, method, args=(), kwargs=None):  # the WorkerHost's calling convention
        return getattr(self, method)(*args, **(kwargs or {}))

    def start_stream(self, data, greedy=False, expected_weight_version=None):
        stream_id = f"s{self.started}"
        self.streams[stream_id] = (data, self.hang_first and self.started == 0)
        self.started += 1
        return stream_id

    def next_finished(self, stream_id, timeout=None):
        data, hangs = self.streams[stream_id]
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

    def cancel_stream(self, stream_id):
        self.cancelled.append(stream_id)
        self.streams.pop(stream_id, None)
        return G

    def get_cancelled(self):
        return self.cancelled


def collate(samples: list[dict]) -> BatchedDataDict:
    return BatchedDataDict(
        message_log=[s["message_log"] for s in samples],
        extra_env_info=[s["extra_env_info"] for s in samples],
        task_name=[s["task_name"] for s in samples],
        idx=[s["idx"] for s in samples],
    )


def prompts(tokenizer, template, n: int) -> list[dict]:
    logs = [[{"role": "user", "content": f"{i}: {first_prompt(BOARD)}"}] for i in range(n)]
    tokenize_message_logs(logs, tokenizer, template, add_generation_prompt=True)
    return [
        {"message_log": log, "extra_env_info": dict(BOARD), "task_name": "sliding_puzzle", "idx": i}
        for i, log in enumerate(logs)
    ]


def start(tokenizer, template, n_prompts: int, hang_first: bool, name: str, **kwargs):
    engine = ray.remote(ScriptedEngine).options(num_cpus=0).remote(tokenizer, hang_first)
    loader = StatefulDataLoader(prompts(tokenizer, template, n_prompts), 2, collate, shuffle=False)
    client = CollectorClient(
        name,
        [engine],
        tokenizer.pad_token_id,
        tokenizer,
        template,
        {"sliding_puzzle": SlidingPuzzleEnvironment(SlidingPuzzleConfig())},
        loader,
        group_size=G,
        max_seq_len=512,
        max_epochs=1,
        max_group_seconds=kwargs.pop("max_group_seconds", 60.0),
        max_groups_ahead=kwargs.pop("max_groups_ahead", 4),
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
                groups += reply["groups"]
                consumed += len(reply["groups"])
    finally:
        client.stop()
    assert ray.get(engine.get_cancelled.remote()) == ["s0"]
    assert reply["requeued_groups"] == 1
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
            taken += client.take(len(taken), timeout=0.5)["groups"]
        state = client.call("state_dict")
    finally:
        client.stop()
    pending = [p["idx"][0] for p in state["pending_prompts"]]
    handed = [g.prompt["idx"][0] for g in taken]
    # Drawn from the loader so far = handed over + pending, with nothing lost or doubled.
    drawn = state["loader"]["position"] * 2
    assert sorted(handed + pending) == list(range(drawn))
    assert 0 in pending  # the hung group's prompt goes to the checkpoint
