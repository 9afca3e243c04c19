"""Rollout bookkeeping with a scripted generator (a test double for the generator only) and the
real sliding-puzzle environment run in-process."""

import re

import pytest
import torch

from rl_algorithms.rollouts import run_rollouts
from rl_data.messages import tokenize_message_logs
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.sliding_puzzle import SlidingPuzzleConfig, SlidingPuzzleEnvironment, first_prompt
from rl_models.generation.interfaces import GenerationInterface, StaleWeightsError


class ScriptedGeneration(GenerationInterface):
    """Answers sample k's turn t with ``script[k][t]`` (the sample's id is in its prompt), plus
    the EOS token, with log-prob -0.25 per token; records what it was asked."""

    def __init__(self, tokenizer, script, weight_version=0, cut=False):
        self.tokenizer, self.script, self.cut = tokenizer, script, cut
        self.weight_version = weight_version
        self.calls = []

    def generate(self, data, greedy=False, *, expected_weight_version=None):
        if expected_weight_version is not None and expected_weight_version != self.weight_version:
            raise StaleWeightsError(self.weight_version, expected_weight_version)
        self.calls.append(data)
        rows, lengths = [], []
        for b in range(data.size):
            prompt = data["input_ids"][b, : data["input_lengths"][b]]
            text = self.tokenizer.decode(prompt.tolist())
            sample = int(re.search(r"\[sample (\d+)\]", text).group(1))
            turn = text.count("<|im_start|>assistant") - 1
            reply = self.tokenizer.encode(self.reply_for(sample, turn), add_special_tokens=False)
            reply = [*reply, self.tokenizer.eos_token_id]
            rows.append(torch.cat([prompt, torch.tensor(reply)]))
            lengths.append(len(reply))
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), self.tokenizer.pad_token_id)
        logprobs = torch.zeros(len(rows), width)
        for b, row in enumerate(rows):
            out[b, : len(row)] = row
            logprobs[b, len(row) - lengths[b] : len(row)] = -0.25
        gen_lengths = torch.tensor(lengths)
        return BatchedDataDict(
            output_ids=out,
            generation_lengths=gen_lengths,
            unpadded_sequence_lengths=data["input_lengths"] + gen_lengths,
            logprobs=logprobs,
            truncated=torch.full((len(rows),), self.cut),  # as if max_new_tokens was hit
        )

    def reply_for(self, sample, turn):
        return self.script[sample][turn]

    def prepare_for_generation(self):
        pass

    def finish_generation(self):
        pass

    def shutdown(self):
        pass


# Blank one step left of its solved place: "right" solves it; "left" then "right right" too.
NEAR_SOLVED = {"board": [[1, 2, 3], [4, 5, 6], [7, 0, 8]], "turn": 0}
SCRIPT = {
    0: ["<action>right</action>"],
    1: ["<action>left</action>", "<action>right right</action>"],
    2: ["no idea", "still no idea"],
}


def puzzle_batch(tokenizer, template, samples=(0, 1, 2)):
    logs = [
        [{"role": "user", "content": f"[sample {k}] {first_prompt(NEAR_SOLVED)}"}] for k in samples
    ]
    tokenize_message_logs(logs, tokenizer, template, add_generation_prompt=True)
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[dict(NEAR_SOLVED) for _ in samples],
        task_name=["puzzle"] * len(samples),
    )


def puzzle_datums(tokenizer, template, samples) -> list[dict]:
    """``puzzle_batch``'s prompts as a data loader's datums (what a run's train loader yields)."""
    batch = puzzle_batch(tokenizer, template, samples=samples)
    return [
        {
            "message_log": log,
            "length": sum(len(m["token_ids"]) for m in log),
            "extra_env_info": dict(NEAR_SOLVED),
            "loss_multiplier": 1.0,
            "idx": i,
            "task_name": "puzzle",
        }
        for i, log in enumerate(batch["message_log"])
    ]


def test_two_turn_rollout_stops_each_sample_at_its_own_end(tokenizer, template):
    batch = puzzle_batch(tokenizer, template)
    prompt_ids = [log[0]["token_ids"].clone() for log in batch["message_log"]]
    gen = ScriptedGeneration(tokenizer, SCRIPT)
    env = SlidingPuzzleEnvironment(SlidingPuzzleConfig(max_turns=8))
    result = run_rollouts(
        gen, batch, tokenizer, template, {"puzzle": env}, max_seq_len=512, max_turns=2
    )

    assert result.rewards.tolist() == [1.0, 1.0, 0.0]
    assert result.terminated.tolist() == [True, True, False]  # sample 2 hit the turn limit
    assert result.truncated.tolist() == [False, False, False]
    assert result.turns.tolist() == [1, 2, 2]
    roles = [[m["role"] for m in log] for log in result.message_logs]
    assert roles == [
        ["user", "assistant"],
        ["user", "assistant", "environment", "assistant"],
        ["user", "assistant", "environment", "assistant"],
    ]
    # Turn 2 generated for the two samples still playing, with the environment's stop strings.
    assert [c.size for c in gen.calls] == [3, 2]
    assert gen.calls[1]["stop_strings"] == [["</action>"], ["</action>"]]
    # The input's logs are untouched; the prompt's ids were carried, not re-tokenised.
    assert [len(log) for log in batch["message_log"]] == [1, 1, 1]
    for log, ids in zip(result.message_logs, prompt_ids, strict=True):
        assert torch.equal(log[0]["token_ids"], ids)
    assert result.metrics["turn_1/active_samples"] == 2.0
    assert result.metrics["mean_turns"] == pytest.approx(5 / 3)


def test_token_ids_are_the_generated_ids_and_turn_two_extends_turn_one(tokenizer, template):
    gen = ScriptedGeneration(tokenizer, SCRIPT)
    env = SlidingPuzzleEnvironment()
    batch = puzzle_batch(tokenizer, template, samples=(1,))
    result = run_rollouts(
        gen, batch, tokenizer, template, {"puzzle": env}, max_seq_len=512, max_turns=2
    )
    log = result.message_logs[0]
    first = gen.calls[0]
    sampled = first["input_lengths"][0]
    reply = [*tokenizer.encode(SCRIPT[1][0], add_special_tokens=False), tokenizer.eos_token_id]
    assistant = log[1]
    n = len(reply)
    assert assistant["token_ids"][:n].tolist() == reply
    assert assistant["token_loss_mask"][:n].tolist() == [1] * n
    # ChatML closes the turn with "<|im_end|>\n": the "\n" is kept, out of the loss.
    assert assistant["token_loss_mask"][n:].sum() == 0 and len(assistant["token_ids"]) > n
    assert assistant["generation_logprobs"][:n].tolist() == [-0.25] * n
    assert int(sampled) == len(log[0]["token_ids"])
    # The second call's prompt is exactly the concatenation of every message's ids so far.
    second = gen.calls[1]
    carried = torch.cat([m["token_ids"] for m in log[:3]])
    assert torch.equal(second["input_ids"][0, : second["input_lengths"][0]], carried)
    # The rendered conversation is what the template gives for the same messages.
    text = tokenizer.decode(torch.cat([m["token_ids"] for m in log]).tolist())
    assert text.startswith(template.render(log[:3], add_generation_prompt=True))


def test_training_batch_masks_all_but_sampled_tokens(tokenizer, template):
    gen = ScriptedGeneration(tokenizer, SCRIPT)
    batch = puzzle_batch(tokenizer, template)
    result = run_rollouts(
        gen,
        batch,
        tokenizer,
        template,
        {"puzzle": SlidingPuzzleEnvironment()},
        max_seq_len=512,
        max_turns=2,
    )
    train = result.training_batch(tokenizer.pad_token_id)
    for b, log in enumerate(result.message_logs):
        sampled = sum(
            int(m.get("token_loss_mask", torch.zeros(1)).sum())
            for m in log
            if m["role"] == "assistant"
        )
        assert int(train.loss_mask[b].sum()) == sampled
        # generation log-probs sit exactly on the loss tokens
        on = train.loss_mask[b] > 0
        assert torch.all(train.generation_logprobs[b][on] == -0.25)
        assert torch.all(train.generation_logprobs[b][~on] == 0)
        assert int(train.input_lengths[b]) == sum(len(m["token_ids"]) for m in log)


def test_a_sample_at_the_length_limit_is_truncated_and_stops(tokenizer, template):
    batch = puzzle_batch(tokenizer, template, samples=(1, 2))
    prompt_len = len(batch["message_log"][0][0]["token_ids"])
    gen = ScriptedGeneration(tokenizer, SCRIPT)
    result = run_rollouts(
        gen,
        batch,
        tokenizer,
        template,
        {"puzzle": SlidingPuzzleEnvironment()},
        max_seq_len=prompt_len + 3,
        max_turns=3,
    )
    assert result.truncated.tolist() == [True, True]
    assert result.turns.tolist() == [1, 1]
    for log in result.message_logs:
        assert sum(len(m["token_ids"]) for m in log) <= prompt_len + 3
    assert result.metrics["truncated_fraction"] == 1.0


class CountingEnv(SlidingPuzzleEnvironment):
    def __init__(self):
        super().__init__()
        self.batch_sizes = []

    def step(self, message_log_batch, metadata):
        self.batch_sizes.append(len(message_log_batch))
        return super().step(message_log_batch, metadata)


def test_environment_steps_are_batched_per_task(tokenizer, template):
    batch = puzzle_batch(tokenizer, template, samples=(0, 1, 2, 1))
    batch["task_name"] = ["a", "b", "a", "b"]
    envs = {"a": CountingEnv(), "b": CountingEnv()}
    result = run_rollouts(
        ScriptedGeneration(tokenizer, SCRIPT),
        batch,
        tokenizer,
        template,
        envs,
        max_seq_len=512,
        max_turns=2,
    )
    assert envs["a"].batch_sizes == [2, 1]  # samples 0 and 2, then 2 alone
    assert envs["b"].batch_sizes == [2, 2]
    assert result.rewards.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_each_environments_own_metrics_come_with_the_rollout(tokenizer, template):
    batch = puzzle_batch(tokenizer, template, samples=(0, 1, 2, 1))
    batch["task_name"] = ["a", "b", "a", "b"]
    batch["idx"] = torch.tensor([0, 1, 2, 1])  # the dataset rows: samples 1 and 3 share one
    envs = {"a": SlidingPuzzleEnvironment(), "b": SlidingPuzzleEnvironment()}
    result = run_rollouts(
        ScriptedGeneration(tokenizer, SCRIPT), batch, tokenizer, template, envs, max_seq_len=512
    )
    assert result.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]  # one turn: only sample 0 solves
    env_metrics = {k: v for k, v in result.metrics.items() if k.startswith("env/")}
    # a: samples 0 and 2 (rewards 1, 0; two rows), b: samples 1 and 3 (0, 0; one row)
    assert env_metrics["env/a/reward_mean"] == 0.5
    assert env_metrics["env/a/accuracy"] == 0.5
    assert env_metrics["env/a/pass@1"] == 0.5
    assert env_metrics["env/b/accuracy"] == 0.0
    assert env_metrics["env/b/samples"] == 2.0


def test_unknown_task_and_stale_weights_are_errors(tokenizer, template):
    batch = puzzle_batch(tokenizer, template, samples=(0,))
    batch["task_name"] = ["nope"]
    with pytest.raises(KeyError, match="nope"):
        run_rollouts(
            ScriptedGeneration(tokenizer, SCRIPT),
            batch,
            tokenizer,
            template,
            {"puzzle": SlidingPuzzleEnvironment()},
            max_seq_len=512,
        )
    batch["task_name"] = ["puzzle"]
    with pytest.raises(StaleWeightsError):
        run_rollouts(
            ScriptedGeneration(tokenizer, SCRIPT, weight_version=1),
            batch,
            tokenizer,
            template,
            {"puzzle": SlidingPuzzleEnvironment()},
            max_seq_len=512,
            expected_weight_version=2,
        )


def test_a_response_cut_at_max_new_tokens_is_flagged_but_the_episode_goes_on(tokenizer, template):
    batch = puzzle_batch(tokenizer, template, samples=(1, 2))
    result = run_rollouts(
        ScriptedGeneration(tokenizer, SCRIPT, cut=True),
        batch,
        tokenizer,
        template,
        {"puzzle": SlidingPuzzleEnvironment()},
        max_seq_len=512,
        max_turns=2,
    )
    assert result.truncated.tolist() == [True, True]
    assert result.turns.tolist() == [2, 2]
    assert result.rewards.tolist() == [1.0, 0.0]


def test_assistant_messages_of_the_prompt_stay_out_of_the_loss(tokenizer, template):
    """A few-shot prompt holds assistant turns the generator never sampled: they must not be
    trained on (they have no generation log-probs and no advantage of their own)."""
    logs = [
        [
            {"role": "user", "content": "[sample 0] Solve this 3x3 sliding puzzle"},
            {"role": "assistant", "content": "<action>up</action>"},
            {"role": "user", "content": f"[sample 0] {first_prompt(NEAR_SOLVED)}"},
        ]
    ]
    tokenize_message_logs(logs, tokenizer, template, add_generation_prompt=True)
    batch = BatchedDataDict(
        message_log=logs, extra_env_info=[dict(NEAR_SOLVED)], task_name=["puzzle"]
    )
    # The few-shot turn makes the generator's first turn count as its second.
    gen = ScriptedGeneration(tokenizer, {0: ["unused", "<action>right</action>"]})
    result = run_rollouts(
        gen, batch, tokenizer, template, {"puzzle": SlidingPuzzleEnvironment()}, max_seq_len=512
    )
    train = result.training_batch(tokenizer.pad_token_id)
    sampled = result.message_logs[0][-1]
    assert int(train.loss_mask[0].sum()) == int(sampled["token_loss_mask"].sum())
    on = train.loss_mask[0] > 0
    assert torch.all(train.generation_logprobs[0][on] == -0.25)


def test_an_observation_past_the_length_limit_is_cut_to_it(tokenizer, template):
    """The turn fits but the environment's answer does not: the sample stops, truncated, and
    its log (the training batch's row) never exceeds max_seq_len."""
    batch = puzzle_batch(tokenizer, template, samples=(1,))
    first = run_rollouts(
        ScriptedGeneration(tokenizer, SCRIPT),
        puzzle_batch(tokenizer, template, samples=(1,)),
        tokenizer,
        template,
        {"puzzle": SlidingPuzzleEnvironment()},
        max_seq_len=512,
        max_turns=1,
    )
    after_turn_one = sum(len(m["token_ids"]) for m in first.message_logs[0])
    limit = after_turn_one + 2  # room for the turn, not for the observation that follows it
    result = run_rollouts(
        ScriptedGeneration(tokenizer, SCRIPT),
        batch,
        tokenizer,
        template,
        {"puzzle": SlidingPuzzleEnvironment()},
        max_seq_len=limit,
        max_turns=3,
    )
    assert result.truncated.tolist() == [True] and result.turns.tolist() == [1]
    log = result.message_logs[0]
    assert sum(len(m["token_ids"]) for m in log) == limit
    train = result.training_batch(tokenizer.pad_token_id)
    assert train.input_ids.shape[1] == limit


def test_take_environment_counts_hands_out_and_resets_what_each_environment_counted():
    from rl_algorithms.rollouts import take_environment_counts

    env = SlidingPuzzleEnvironment()
    logs = [[{"role": "assistant", "content": "<action>right</action>"}]] * 3
    env.step(logs, [dict(NEAR_SOLVED) for _ in logs])
    counts = take_environment_counts({"puzzle": env})
    assert counts["env/puzzle/samples"] == 3.0
    assert "env/puzzle/reward_mean" not in counts  # no samples given: no reward metrics
    assert take_environment_counts({"puzzle": env})["env/puzzle/samples"] == 0.0


THINK_STRIPPING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_turn_the_template_renders_otherwise_is_counted_and_warned_of(tokenizer, caplog):
    """A template that drops a think block cannot close the sampled turn as it renders it: the
    turn keeps its sampled tokens alone (no template tail), and the rollout says so."""
    from rl_algorithms import episodes
    from rl_data.templates import ChatTemplate, ChatTemplateConfig

    template = ChatTemplate.from_config(
        ChatTemplateConfig(kind="jinja", template=THINK_STRIPPING, cache_frames=False), tokenizer
    )
    batch = puzzle_batch(tokenizer, template, samples=(0, 1))
    script = {0: ["<think>up?</think><action>right</action>"], 1: ["<action>right</action>"]}
    env = SlidingPuzzleEnvironment(SlidingPuzzleConfig(max_turns=8))
    episodes._warned_of_template_mismatch = False
    with caplog.at_level("WARNING", logger=episodes.__name__):
        result = run_rollouts(
            ScriptedGeneration(tokenizer, script),
            batch,
            tokenizer,
            template,
            {"puzzle": env},
            max_seq_len=512,
        )
    assert result.metrics["template_mismatched_turns"] == 1.0
    assert "renders a generated turn otherwise than it was sampled" in caplog.text
    thinking, plain = (log[-1] for log in result.message_logs)
    assert thinking["token_loss_mask"].all()  # only what was sampled: no closing text
    assert not plain["token_loss_mask"].all()  # the template's "\n" after <|im_end|>


MISTRAL_CALL = '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "12*34"}}]'


def test_a_tool_call_marker_that_is_a_special_token_stays_in_the_turns_text():
    """Mistral's ``[TOOL_CALLS]`` is a special token of its tokenizer (here a tiny tokenizer
    given it as one): the turn's text must keep it, or the mistral parser finds no call. The
    stop token, which the chat template writes itself, stays out of the text, and the turn is
    rendered as it was sampled."""
    from rl_data.templates import ChatTemplate, ChatTemplateConfig
    from rl_data.tokenizers import build_tokenizer, encode_texts
    from rl_envs.tools.parsers import ToolCall, parse_tool_calls

    from .conftest import CORPUS

    tokenizer = build_tokenizer([*CORPUS, MISTRAL_CALL * 20], vocab_size=400)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    assert encode_texts(tokenizer, [MISTRAL_CALL])[0][0] == marker  # one special token
    template = ChatTemplate.from_config(ChatTemplateConfig(), tokenizer)
    batch = puzzle_batch(tokenizer, template, samples=(0,))
    env = SlidingPuzzleEnvironment(SlidingPuzzleConfig(max_turns=8))
    result = run_rollouts(
        ScriptedGeneration(tokenizer, {0: [MISTRAL_CALL]}),
        batch,
        tokenizer,
        template,
        {"puzzle": env},
        max_seq_len=512,
    )

    turn = result.message_logs[0][-1]
    assert turn["content"] == MISTRAL_CALL
    calls = parse_tool_calls(turn["content"], "mistral").calls
    assert calls == [ToolCall("call_0", "calculator", {"expression": "12*34"})]
    assert result.metrics["template_mismatched_turns"] == 0.0
    # The sampled ids (the marker first, EOS last) in the loss, the template's tail after them.
    sampled = turn["token_ids"][turn["token_loss_mask"].bool()].tolist()
    assert sampled == [*encode_texts(tokenizer, [MISTRAL_CALL])[0], tokenizer.eos_token_id]


def test_an_unscored_step_ends_its_episode_out_of_the_loss(tokenizer, template):
    """An environment that answers without a score (a reward server that never replied) ends
    that episode with ``unscored``, even mid-game; the loss leaves it out, the others stay in."""

    class FirstUnscored(SlidingPuzzleEnvironment):
        def step(self, logs, metadata):
            out = super().step(logs, metadata)
            unscored = torch.tensor(["[sample 0]" in log[0]["content"] for log in logs])
            return out._replace(unscored=unscored)

    env = FirstUnscored(SlidingPuzzleConfig(max_turns=8))
    result = run_rollouts(
        ScriptedGeneration(tokenizer, SCRIPT),
        puzzle_batch(tokenizer, template),
        tokenizer,
        template,
        {"puzzle": env},
        max_seq_len=512,
        max_turns=2,
    )
    assert result.end_reasons == ["unscored", "terminated", "turn_limit"]
    assert result.sample_mask().tolist() == [0.0, 1.0, 1.0]
    assert result.metrics["end_reason/unscored"] == pytest.approx(1 / 3)
