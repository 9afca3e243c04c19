"""Per-token weight versions: a turn sampled across two refits keeps, token by token, the
version and the log-prob each token was sampled with, from the generator's output through
``Episodes`` and the training batch into the loss, whose importance weight for each token uses
that token's own generator log-prob (checked against a float64 reference by hand)."""

import dataclasses

import pytest
import torch

from rl_algorithms.episodes import Episodes, version_span
from rl_algorithms.losses import ClippedPGLossFn
from rl_data.messages import tokenize_message_logs
from rl_distributed.batched_data_dict import BatchedDataDict

V = 7  # the version the turn started on; refits to V + 1 and V + 2 land while it is sampled


def one_episode(tokenizer, template) -> tuple[Episodes, torch.Tensor]:
    log = [{"role": "user", "content": "[sample 0] Solve this"}]
    tokenize_message_logs([log], tokenizer, template, add_generation_prompt=True)
    batch = BatchedDataDict(message_log=[log], extra_env_info=[{}], task_name=["t"])
    prompt = torch.cat([m["token_ids"] for m in log])
    return Episodes(batch, tokenizer, template, {"t": None}, max_seq_len=256), prompt


def turn(prompt, sampled, logprobs, **versions) -> BatchedDataDict:
    """A generator's one-row output: ``sampled`` after ``prompt``, its log-probs, versions."""
    n, L = len(prompt), len(sampled)
    lps = torch.zeros(1, n + L)
    lps[0, n:] = torch.tensor(logprobs)
    out = BatchedDataDict(
        output_ids=torch.cat([prompt, torch.tensor(sampled)])[None],
        generation_lengths=torch.tensor([L]),
        logprobs=lps,
        truncated=torch.tensor([False]),
        **{k: torch.tensor([v]) for k, v in versions.items()},
    )
    return out


def sampled_tokens(tokenizer) -> list[int]:
    reply = tokenizer.encode("<action>right</action>", add_special_tokens=False)
    return [*reply, tokenizer.eos_token_id]


def test_a_turn_across_two_refits_trains_each_token_against_its_own_log_prob(tokenizer, template):
    episodes, prompt = one_episode(tokenizer, template)
    sampled = sampled_tokens(tokenizer)
    L = len(sampled)
    assert L >= 3
    # Tokens from V, then V + 1, then V + 2 (the worker knew the boundaries).
    versions = [V] * (L // 3) + [V + 1] * (L // 3) + [V + 2] * (L - 2 * (L // 3))
    # Older weights gave the sampled tokens lower log-probs: each token its own.
    gen = [-0.5 - 0.25 * (V + 2 - v) - 0.01 * k for k, v in enumerate(versions)]
    n = len(prompt)
    out = turn(
        prompt,
        sampled,
        gen,
        generation_versions=[-1] * n + versions,
        weight_version_min=V,
        weight_version_max=V + 2,
    )
    episodes.add_response(0, out, 0)
    message = episodes.logs[0][-1]
    assert message["generation_versions"][:L].tolist() == versions
    assert version_span(episodes.logs[0]) == (V, V + 2)

    batch = episodes.result(with_env_metrics=False).training_batch(tokenizer.pad_token_id)
    tokens = (batch.loss_mask[0] > 0).nonzero().flatten()
    assert tokens.tolist() == list(range(n, n + L))  # the sampled tokens, in place
    assert batch.extras["generation_versions"][0, tokens].tolist() == versions
    gen32 = torch.tensor(gen, dtype=torch.float32)
    assert torch.equal(batch.generation_logprobs[0, tokens], gen32)

    # The trainer's pi_old and current log-probs, the ratio pi / pi_old inside the clip range.
    S = batch.input_ids.shape[1]
    prev = torch.full((1, S), -0.4, dtype=torch.float64)
    prev[0, tokens] = torch.linspace(-0.6, -0.3, L, dtype=torch.float64)
    lp = (prev + 0.05).clone().requires_grad_(True)
    train = dataclasses.replace(
        batch, advantages=torch.ones(1, S, dtype=torch.float64), prev_logprobs=prev
    )
    loss_fn = ClippedPGLossFn({"use_importance_sampling_correction": True})
    toks = train.loss_token_mask().sum()
    loss, _ = loss_fn(lp, train, torch.tensor(1.0), toks)
    (grad,) = torch.autograd.grad(loss, lp)

    # By hand, float64: token t's loss is -A * r_t * w_t with r_t = exp(lp_t - prev_t) and
    # w_t = exp(prev_t - gen_t), gen_t the log-prob of the weights that sampled token t.
    g = gen32.double()
    p = prev[0, tokens]
    r = torch.exp(torch.full((L,), 0.05, dtype=torch.float64))
    w = torch.exp(p - g)
    expected = (-r * w).sum() / L
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    # Each token's gradient carries its own weight: -r_t * w_t / L.
    torch.testing.assert_close(grad[0, tokens], -r * w / L, rtol=1e-12, atol=0)
    # Tagging the whole turn with its first version's log-probs would train otherwise.
    first = torch.full((L,), float(gen32[0]), dtype=torch.float64)
    assert abs((-r * torch.exp(p - first)).sum().item() / L - expected.item()) > 1e-3


def test_without_boundaries_every_token_of_a_turn_is_tagged_with_its_oldest_version(
    tokenizer, template
):
    # A runner that reports only the oldest and newest version of a sample: its tokens are
    # tagged with the oldest (ages from the tags are never too young); the newest is kept.
    episodes, prompt = one_episode(tokenizer, template)
    sampled = sampled_tokens(tokenizer)
    out = turn(
        prompt, sampled, [-0.5] * len(sampled), weight_version_min=V, weight_version_max=V + 2
    )
    episodes.add_response(0, out, 0)
    message = episodes.logs[0][-1]
    assert message["generation_versions"][: len(sampled)].tolist() == [V] * len(sampled)
    assert version_span(episodes.logs[0]) == (V, V + 2)


def test_a_generator_without_versions_tags_nothing(tokenizer, template):
    episodes, prompt = one_episode(tokenizer, template)
    sampled = sampled_tokens(tokenizer)
    episodes.add_response(0, turn(prompt, sampled, [-0.5] * len(sampled)), 0)
    assert "generation_versions" not in episodes.logs[0][-1]
    assert version_span(episodes.logs[0]) is None
    batch = episodes.result(with_env_metrics=False).training_batch(tokenizer.pad_token_id)
    assert batch.extras == {}


def test_an_empty_turn_with_a_template_tail_is_as_young_as_its_generator_says(tokenizer, template):
    # Nothing sampled (length 0) but the template closes the turn with tokens out of the loss:
    # those tokens are no sample, so they must not make the episode look version 0 (the
    # oldest possible: such a group was dropped as stale and generated again, for ever).
    episodes, prompt = one_episode(tokenizer, template)
    episodes.add_response(0, turn(prompt, [], [], weight_version_min=V, weight_version_max=V), 0)
    message = episodes.logs[0][-1]
    assert int(message["token_loss_mask"].sum()) == 0 and len(message["token_ids"]) > 0
    assert version_span(episodes.logs[0]) == (V, V)
    # A later turn's sampled tokens set the oldest version, the tail's tags do not.
    log = episodes.logs[0]
    prompt = torch.cat([m["token_ids"] for m in log])
    sampled = sampled_tokens(tokenizer)
    out = turn(prompt, sampled, [-0.5] * len(sampled), weight_version_min=V + 1)
    episodes.add_response(0, out, 0)
    assert version_span(episodes.logs[0]) == (V + 1, V + 1)
