"""The agent loop: episodes at their own pace, their limits, token in / token out.

Fast tests use an in-process tool environment whose replies take as long as each sample says
(or wait on an event), and a generator test double that samples random token ids: ids that do
not survive a decode / encode round trip, so that any re-tokenisation would show."""

import itertools
import threading
import time
import zlib

import pytest
import torch

from rl_algorithms.agent_loop import AgentLoopConfig
from rl_algorithms.rollouts import run_lockstep_rollouts, run_rollouts
from rl_data.messages import tokenize_message_logs
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn
from rl_models.generation.interfaces import GenerationInterface
from rl_models.generation.seeds import SEEDS_KEY, SamplingSeeds
from rl_models.modeling.random_streams import row_seed

from .conftest import TINY_LLAMA

PER_EPISODE = AgentLoopConfig(env_steps="per_episode")


def generated_output(data, prompts, samples, pad_id) -> BatchedDataDict:
    """What a generator returns for ``data``: each prompt followed by its sample's ids, with
    the sample's log-probs, as ``generate``'s output keys (``samples``: ``(ids, logprobs)``)."""
    width = max(len(p) + len(s) for p, (s, _) in zip(prompts, samples, strict=True))
    out = torch.full((data.size, width), pad_id)
    logprobs = torch.zeros(data.size, width)
    for b, (prompt, (ids, lps)) in enumerate(zip(prompts, samples, strict=True)):
        out[b, : len(prompt) + len(ids)] = torch.cat([prompt, ids])
        logprobs[b, len(prompt) : len(prompt) + len(ids)] = lps
    lengths = torch.tensor([len(s) for s, _ in samples])
    return BatchedDataDict(
        output_ids=out,
        generation_lengths=lengths,
        unpadded_sequence_lengths=data["input_lengths"] + lengths,
        logprobs=logprobs,
        truncated=torch.zeros(data.size, dtype=torch.bool),
    )


class RandomTokenGeneration(GenerationInterface):
    """Samples 3-6 random non-special token ids and EOS per row, drawn from the row's prompt
    (so a row samples the same whatever batch it is in); records each row's prompt, sampled
    ids and log-probs, and each call's seeds."""

    def __init__(self, tokenizer, seeds: SamplingSeeds | None = None):
        self.tokenizer, self.weight_version = tokenizer, 0
        if seeds is not None:
            self.seeds = seeds
        self.rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.call_seeds: list[torch.Tensor | None] = []
        self.lock = threading.Lock()

    def generate(self, data, greedy=False, *, expected_weight_version=None):
        special = set(self.tokenizer.all_special_ids)
        vocab = torch.tensor([t for t in range(len(self.tokenizer)) if t not in special])
        prompts = [data["input_ids"][b, : data["input_lengths"][b]] for b in range(data.size)]
        samples = []
        for prompt in prompts:
            rng = torch.Generator().manual_seed(zlib.crc32(prompt.numpy().tobytes()))
            n = int(torch.randint(3, 7, (1,), generator=rng))
            ids = vocab[torch.randint(len(vocab), (n,), generator=rng)]
            ids = torch.cat([ids, torch.tensor([self.tokenizer.eos_token_id])])
            samples.append((ids, -torch.rand(len(ids), generator=rng)))
        with self.lock:
            self.rows += [(p, s, lp) for p, (s, lp) in zip(prompts, samples, strict=True)]
            self.call_seeds.append(data.get(SEEDS_KEY))
        return generated_output(data, prompts, samples, self.tokenizer.pad_token_id)

    def prepare_for_generation(self):
        pass

    def finish_generation(self):
        pass

    def shutdown(self):
        pass


class ToolEnv(EnvironmentInterface):
    """Answers each turn with a ``role: tool`` reply after the sample's ``delays[turn]``
    seconds (``"hang"``: until ``release`` is set; ``"last"``: until every other episode has
    had its final reply); ends an episode with reward 1 after its ``turns`` turns. Records the
    ``(id, turn)`` of every reply in the order given, and the size of each call. Safe to call
    from several threads (though it does not say so: ``ConcurrentToolEnv`` does)."""

    def __init__(self, episodes: int = 0):
        self.lock = threading.Lock()
        self.replied: list[tuple[int, int]] = []
        self.release = threading.Event()
        self.others_done = threading.Event()
        self.episodes, self.finished = episodes, 0
        self.waited_for_others: bool | None = None
        self.call_sizes: list[int] = []

    def step(self, message_log_batch, metadata):
        with self.lock:
            self.call_sizes.append(len(metadata))
        out = []
        for meta in metadata:
            turn, delay = meta["turn"], meta["delays"][min(meta["turn"], len(meta["delays"]) - 1)]
            if delay == "hang":
                self.release.wait(30)
            elif delay == "last":
                self.waited_for_others = self.others_done.wait(10)
            else:
                time.sleep(delay)
            done = turn + 1 >= meta["turns"]
            with self.lock:
                self.replied.append((meta["id"], turn))
                if done and delay != "last":
                    self.finished += 1
                    if self.finished == self.episodes - 1:
                        self.others_done.set()
            reply = [{"role": "tool", "content": f"result {turn}", "tool_call_id": str(turn)}]
            out.append((reply, {**meta, "turn": turn + 1}, float(done), done))
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


class ConcurrentToolEnv(ToolEnv):
    concurrent_steps = True


def tool_batch(tokenizer, template, episodes: list[dict]) -> BatchedDataDict:
    """One prompt per episode; ``episodes[k]``: its ``turns`` and ``delays``."""
    logs = [[{"role": "user", "content": f"[sample {k}] Solve this"}] for k in range(len(episodes))]
    tokenize_message_logs(logs, tokenizer, template, add_generation_prompt=True)
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[{"id": k, "turn": 0, **e} for k, e in enumerate(episodes)],
        task_name=["tools"] * len(episodes),
    )


def roll(gen, batch, tokenizer, template, env, max_turns=5, loop=PER_EPISODE, **kwargs):
    return run_rollouts(
        gen,
        batch,
        tokenizer,
        template,
        {"tools": env},
        max_seq_len=512,
        max_turns=max_turns,
        loop=loop,
        **kwargs,
    )


def test_a_slow_tool_does_not_hold_back_the_other_episodes(tokenizer, template):
    # Episode 0's first tool call returns only once both others have played all their three
    # turns: a loop that waited for it would stall (and find the event unset after 10 s).
    episodes = [{"turns": 2, "delays": ["last", 0]}] + [{"turns": 3, "delays": [0]}] * 2
    env = ToolEnv(episodes=3)
    result = roll(
        RandomTokenGeneration(tokenizer),
        tool_batch(tokenizer, template, episodes),
        tokenizer,
        template,
        env,
    )
    assert env.waited_for_others is True
    first_slow = env.replied.index((0, 0))
    assert set(env.replied[:first_slow]) == {(k, t) for k in (1, 2) for t in range(3)}
    assert result.end_reasons == ["terminated"] * 3
    assert result.turns.tolist() == [2, 3, 3]
    assert result.tool_calls.tolist() == [2, 3, 3]
    assert result.rewards.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("env_class", "call_sizes"), [(ToolEnv, [3, 3]), (ConcurrentToolEnv, [1] * 6)]
)
def test_by_default_only_an_environment_of_concurrent_steps_is_stepped_per_episode(
    tokenizer, template, env_class, call_sizes
):
    env = env_class()
    result = roll(
        RandomTokenGeneration(tokenizer),
        tool_batch(tokenizer, template, [{"turns": 2, "delays": [0]}] * 3),
        tokenizer,
        template,
        env,
        loop=AgentLoopConfig(),
    )
    assert env.call_sizes == call_sizes
    assert result.end_reasons == ["terminated"] * 3


def test_a_hanging_tool_is_cut_at_its_timeout(tokenizer, template):
    episodes = [{"turns": 2, "delays": ["hang"]}, {"turns": 2, "delays": [0]}]
    env = ToolEnv()
    loop = AgentLoopConfig(env_steps="per_episode", env_step_timeout_s=0.3)
    try:
        result = roll(
            RandomTokenGeneration(tokenizer),
            tool_batch(tokenizer, template, episodes),
            tokenizer,
            template,
            env,
            loop=loop,
        )
        assert not env.release.is_set()  # the rollout did not wait for the hanging call
    finally:
        env.release.set()
    assert result.end_reasons == ["env_timeout", "terminated"]
    assert result.turns.tolist() == [1, 2]
    assert result.rewards.tolist() == [0.0, 1.0]
    assert result.metrics["end_reason/env_timeout"] == 0.5
    # Its reward of 0 says nothing of the policy: the episode stays out of the loss.
    assert result.sample_mask().tolist() == [0.0, 1.0]
    # The cut episode ends with its unscored turn: no reply was appended.
    assert result.message_logs[0][-1]["role"] == "assistant"


class CancellableSleeper:
    """A Ray actor (serving one call at a time) whose step sleeps ``seconds`` in short slices,
    stopping early once Ray marks the call cancelled, as a long step can; it records each
    step it starts and whether it stopped early."""

    def __init__(self, seconds: float):
        self.seconds, self.started, self.stopped_early = seconds, 0, 0

    def step(self, message_log_batch, metadata):
        import ray

        self.started += 1
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            if ray.get_runtime_context().is_canceled():
                self.stopped_early += 1
                break
            time.sleep(0.01)
        n = len(metadata)
        return EnvironmentReturn(
            observations=[[{"role": "tool", "content": "slept"}]] * n,
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.zeros(n),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=[None] * n,
        )

    def record(self) -> tuple[int, int]:
        return self.started, self.stopped_early

    def global_post_process_and_metrics(self, batch):
        return batch, {}


@pytest.mark.ray
def test_a_step_cut_at_its_timeout_is_cancelled_on_the_actor(ray_session, tokenizer, template):
    """Two episodes, each stepped on its own call of an actor that serves one call at a time:
    the first step sleeps, the second waits behind it, both are cut at the timeout. Cancelled,
    each stops as soon as it sees so (or never runs), so the actor is free for its next call
    (``record``, answered only once it is) long before the steps' sleep would end."""
    import ray

    actor = ray.remote(CancellableSleeper).options(num_cpus=0).remote(seconds=5.0)
    loop = AgentLoopConfig(env_steps="per_episode", env_step_timeout_s=0.5)
    try:
        assert ray.get(actor.record.remote()) == (0, 0)  # started, before its first step
        result = roll(
            RandomTokenGeneration(tokenizer),
            tool_batch(tokenizer, template, [{"turns": 1, "delays": [0]}] * 2),
            tokenizer,
            template,
            actor,
            loop=loop,
        )
        assert result.end_reasons == ["env_timeout", "env_timeout"]
        started, stopped_early = ray.get(actor.record.remote(), timeout=30)
    finally:
        ray.kill(actor)
    assert started >= 1 and stopped_early == started


@pytest.mark.parametrize(
    ("loop", "max_turns", "reason", "turns"),
    [
        (PER_EPISODE, 2, "turn_limit", 2),
        (AgentLoopConfig(max_tool_calls=3), 10, "tool_call_limit", 3),
    ],
)
def test_an_episode_stops_at_its_limit(tokenizer, template, loop, max_turns, reason, turns):
    episodes = [{"turns": 10, "delays": [0]}, {"turns": 1, "delays": [0]}]
    result = roll(
        RandomTokenGeneration(tokenizer),
        tool_batch(tokenizer, template, episodes),
        tokenizer,
        template,
        ToolEnv(),
        max_turns=max_turns,
        loop=loop,
    )
    assert result.end_reasons == [reason, "terminated"]
    assert result.turns.tolist() == [turns, 1]
    assert result.tool_calls.tolist() == [turns, 1]
    # The last reply of a stopped episode is not appended: nothing follows its last turn.
    assert [m["role"] for m in result.message_logs[0]][-3:] == ["assistant", "tool", "assistant"]
    assert result.metrics["mean_turns"] == (turns + 1) / 2


def test_an_episode_past_its_wall_time_starts_no_new_turn(tokenizer, template):
    episodes = [{"turns": 10, "delays": [0.2]}, {"turns": 1, "delays": [0]}]
    loop = AgentLoopConfig(env_steps="per_episode", max_episode_seconds=0.3)
    result = roll(
        RandomTokenGeneration(tokenizer),
        tool_batch(tokenizer, template, episodes),
        tokenizer,
        template,
        ToolEnv(),
        max_turns=10,
        loop=loop,
    )
    assert result.end_reasons == ["time_limit", "terminated"]
    assert 1 <= int(result.turns[0]) < 10
    assert result.timings["episode_seconds_max"] >= 0.3


def test_trained_tokens_are_the_sampled_tokens_across_turns(tokenizer, template):
    episodes = [{"turns": 3, "delays": [0.05, 0, 0.02]}, {"turns": 3, "delays": [0, 0.03]}]
    gen = RandomTokenGeneration(tokenizer)
    batch = tool_batch(tokenizer, template, episodes)
    result = roll(gen, batch, tokenizer, template, ToolEnv())
    train = result.training_batch(tokenizer.pad_token_id)
    round_trip_differs = False
    for b, log in enumerate(result.message_logs):
        first = log[0]["token_ids"]
        mine = [r for r in gen.rows if torch.equal(r[0][: len(first)], first)]
        assert len(mine) == 3  # one generate row per turn
        mine.sort(key=lambda r: len(r[0]))
        for (prompt, ids, _), (later, _, _) in itertools.pairwise(mine):
            # Each turn is generated from the previous turn's input and its sampled ids, as is.
            assert torch.equal(later[: len(prompt) + len(ids)], torch.cat([prompt, ids]))
        sampled = torch.cat([ids for _, ids, _ in mine])
        n = int(train.input_lengths[b])
        trained = train.input_ids[b, :n][train.loss_mask[b, :n] > 0]
        assert trained.numpy().tobytes() == sampled.numpy().tobytes()
        torch.testing.assert_close(
            train.generation_logprobs[b, :n][train.loss_mask[b, :n] > 0],
            torch.cat([lps for _, _, lps in mine]),
            rtol=0,
            atol=0,
        )
        # The trained row starts with the last turn's input, as it was sampled from.
        last_prompt = mine[-1][0]
        assert torch.equal(train.input_ids[b, : len(last_prompt)], last_prompt)
        for _, ids, _ in mine:
            text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
            round_trip_differs |= tokenizer.encode(text, add_special_tokens=False) != ids.tolist()
    assert round_trip_differs  # re-tokenising the responses would have changed them


def test_the_agent_loop_rolls_out_what_the_lockstep_loop_does(tokenizer, template):
    episodes = [{"turns": 3, "delays": [0.03, 0]}, {"turns": 2, "delays": [0]}, {"turns": 4}]
    episodes[2]["delays"] = [0, 0.02, 0]
    batch = tool_batch(tokenizer, template, episodes)
    args = (batch, tokenizer, template, {"tools": ToolEnv()})
    ours = run_rollouts(
        RandomTokenGeneration(tokenizer), *args, max_seq_len=512, max_turns=3, loop=PER_EPISODE
    )
    ref = run_lockstep_rollouts(
        RandomTokenGeneration(tokenizer), *args, max_seq_len=512, max_turns=3
    )
    for a, b in zip(ours.message_logs, ref.message_logs, strict=True):
        assert torch.equal(
            torch.cat([m["token_ids"] for m in a]), torch.cat([m["token_ids"] for m in b])
        )
    assert ours.rewards.tolist() == ref.rewards.tolist() == [1.0, 1.0, 0.0]
    assert ours.end_reasons == ref.end_reasons == ["terminated", "terminated", "turn_limit"]
    for key in ("turn_0/active_samples", "turn_2/mean_generation_length", "turn_1/reward_mean"):
        assert ours.metrics[key] == ref.metrics[key]


def test_each_turn_of_an_episode_has_its_own_seed_whatever_its_batch(tokenizer, template):
    """Turn 0 takes the seeds the lockstep loop's first call would; later turns a seed of the
    episode and the turn alone (not of the row's place in a batch, which timing decides)."""
    episodes = [{"turns": 2, "delays": [0.05]}, {"turns": 3, "delays": [0]}]
    gen = RandomTokenGeneration(tokenizer, seeds=SamplingSeeds(7))
    gen.weight_version = 3
    roll(gen, tool_batch(tokenizer, template, episodes), tokenizer, template, ToolEnv())
    base = SamplingSeeds(7).next_call(3, 2).tolist()
    want = {base[0], base[1], row_seed(base[0], 1), row_seed(base[1], 1), row_seed(base[1], 2)}
    got = [s for call in gen.call_seeds for s in call.tolist()]  # type: ignore[union-attr]
    assert sorted(got) == sorted(want)
    assert gen.call_seeds[0].tolist() == base  # type: ignore[union-attr]


@pytest.mark.ray
def test_two_generation_workers_and_two_calls_in_flight(ray_session, tokenizer, template, tmp_path):
    """A real HF generator of two workers, two generate calls in flight, tool replies at
    different speeds: greedy, each episode gets what the lockstep loop gives it."""
    from rl_distributed import RayVirtualCluster
    from rl_models.generation.hf_generation import HfGeneration

    tokenizer.save_pretrained(tmp_path / "tok")
    generation = HfGeneration(
        RayVirtualCluster([2], use_gpus=False),
        {
            "backend": "hf",
            "colocated": False,
            "tokenizer": str(tmp_path / "tok"),
            "sampling": {"max_new_tokens": 4},
        },
        model={"hf_config": {**TINY_LLAMA, "vocab_size": len(tokenizer)}, "dtype": "float32"},
    )
    try:
        episodes = [{"turns": 3, "delays": [0.2, 0]}, {"turns": 3, "delays": [0]}]
        episodes += [{"turns": 2, "delays": [0, 0.1]}, {"turns": 3, "delays": [0]}]
        batch = tool_batch(tokenizer, template, episodes)
        args = (batch, tokenizer, template, {"tools": ToolEnv()})
        loop = AgentLoopConfig(env_steps="per_episode", max_concurrent_generations=2)
        ours = run_rollouts(generation, *args, max_seq_len=256, max_turns=3, greedy=True, loop=loop)
        ref = run_lockstep_rollouts(generation, *args, max_seq_len=256, max_turns=3, greedy=True)
    finally:
        generation.shutdown()
    assert ours.timings["agent_loop/generation_calls"] > 3  # not one call per turn
    for a, b in zip(ours.message_logs, ref.message_logs, strict=True):
        assert [m["role"] for m in a] == [m["role"] for m in b]
        assert torch.equal(
            torch.cat([m["token_ids"] for m in a]), torch.cat([m["token_ids"] for m in b])
        )
    assert ours.end_reasons == ref.end_reasons
