"""The entropy bonus of ``ClippedPGLossFn`` (``entropy_coef``): values and gradients with
respect to the logits against a float64 reference written from the definition, under each
normalisation, with padding and masks, split into micro-batches; and the metrics a loss
declares (``token_entropy`` among them when the bonus is on)."""

import pytest
import torch

from rl_algorithms.losses import ClippedPGLossFn
from rl_algorithms.losses.clipped_pg import GENERATOR_METRICS
from rl_data.batch import TrainBatch
from rl_models.interfaces import LossTokenLogprobs, LossTokenLogprobsAndEntropy, loss_input_type

from .test_pg_toolkit import CONFIGS, SEEDS, counts, loss_tokens, reference, toolkit_batch

VOCAB = 50  # the batch's token ids are below 50
COEF = 0.3
ENTROPY_CONFIGS = {
    "grpo": {},  # token-level
    "sapo-sequence-mean": CONFIGS["sapo-sequence-mean"],  # sample-level
    "dr-grpo": CONFIGS["dr-grpo"],  # the constant normaliser
    "cispo+icepop+off-policy": CONFIGS["cispo+icepop+off-policy"],
}


def logits_batch(seed: int):
    """``toolkit_batch`` with its log-probs made from ``[B, S, V]`` logits (the batch's pi_old
    and generator log-probs moved with them, so ratios and drifts stay as they were), and the
    policy's input ``[B, S, 2]``: log-probs and entropies, garbage off the loss tokens."""
    lp0, data = toolkit_batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    logits = (torch.randn(*lp0.shape, VOCAB, generator=g, dtype=torch.float64) * 2).requires_grad_()
    ids = data["input_ids"]
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, ids[..., None])[..., 0]
    shift = lp.detach() - lp0.detach()
    data["prev_logprobs"] = data["prev_logprobs"] + shift
    data["generation_logprobs"] = data["generation_logprobs"] + shift
    entropy = -(logp.exp() * logp).sum(-1)
    on = TrainBatch.from_transport(data).loss_token_mask() > 0
    garbage = torch.tensor(float("inf"), dtype=torch.float64)
    values = torch.stack([torch.where(on, lp, -garbage), torch.where(on, entropy, garbage)], -1)
    return logits, values, data


def entropy_reference(logits, data, c: dict):
    """The bonus alone, token by token: H_t = -sum_v p_v log p_v, reduced like the loss."""
    per_sample, all_h, n_samples = [], [], 0
    for b in range(logits.shape[0]):
        if data["sample_mask"][b] == 0:
            continue
        n_samples += 1
        hs = []
        for t in loss_tokens(data, b):
            p = torch.softmax(logits[b, t], -1)
            hs.append(-sum(p[v] * torch.log(p[v]) for v in range(VOCAB)))
        all_h.extend(hs)
        if hs:
            per_sample.append(sum(hs) / len(hs))
    if c.get("constant_length_normalizer") is not None:
        return sum(all_h) / (n_samples * c["constant_length_normalizer"]), all_h
    if c.get("token_level_loss", True):
        return sum(all_h) / len(all_h), all_h
    return sum(per_sample) / n_samples, all_h


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ENTROPY_CONFIGS)
def test_loss_and_logit_gradient_match_the_definition(name, seed):
    config = {**ENTROPY_CONFIGS[name], "entropy_coef": COEF}
    logits, values, data = logits_batch(seed)
    loss_fn = ClippedPGLossFn(config)
    loss, metrics = loss_fn(values, TrainBatch.from_transport(data), *counts(data))
    (grad,) = torch.autograd.grad(loss, logits)

    lp = torch.log_softmax(logits, -1).gather(-1, data["input_ids"][..., None])[..., 0]
    bonus, all_h = entropy_reference(logits, data, config)
    expected = reference(lp, data, config) - COEF * bonus
    (expected_grad,) = torch.autograd.grad(expected, logits)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert metrics["token_entropy"] == pytest.approx(
        float(sum(all_h).detach()) / len(all_h), rel=1e-10
    )
    # The bonus is not a no-op: without it the loss differs by COEF times the mean entropy.
    without = ClippedPGLossFn(ENTROPY_CONFIGS[name])(
        values[..., 0].detach(), TrainBatch.from_transport(data), *counts(data)
    )[0]
    assert loss.item() - without.item() == pytest.approx(-COEF * float(bonus.detach()), rel=1e-9)


def test_micro_batches_add_up_to_the_whole_batch(split_matches_whole):
    _, values, data = logits_batch(1)
    values = values.detach().requires_grad_()
    seqs, toks = counts(data)
    loss_fn = ClippedPGLossFn({**CONFIGS["cispo+icepop+off-policy"], "entropy_coef": COEF})
    whole_m, parts = split_matches_whole(
        loss_fn, values, data, [(0, 2), (2, 5), (5, 7)], seqs, toks
    )
    assert sum(m["token_entropy"] for m in parts) == pytest.approx(whole_m["token_entropy"])


def test_off_it_asks_for_log_probs_only_and_computes_nothing_more():
    assert loss_input_type(ClippedPGLossFn()) is LossTokenLogprobs
    on = ClippedPGLossFn({"entropy_coef": COEF})
    assert loss_input_type(on) is LossTokenLogprobsAndEntropy
    assert ClippedPGLossFn.input_type is LossTokenLogprobs  # the class is left alone
    _, values, data = logits_batch(0)
    _, metrics = ClippedPGLossFn()(
        values[..., 0].detach(), TrainBatch.from_transport(data), *counts(data)
    )
    assert "token_entropy" not in metrics
    with pytest.raises(ValueError, match=r"loss_fn.entropy_coef=0.3 needs \[B, S, 2\]"):
        on(values[..., 0].detach(), TrainBatch.from_transport(data), *counts(data))
    with pytest.raises(ValueError, match="entropy_coef"):
        ClippedPGLossFn({"entropy_coef": -0.1})


@pytest.mark.parametrize("coef", [0.0, COEF])
@pytest.mark.parametrize("name", ["grpo", *CONFIGS])
def test_an_instances_metrics_are_the_keys_every_call_returns(name, coef):
    """``METRICS`` of a loss (what checkpoints may be ranked by): what a call returns under
    its config; a batch that carries the generator's log-probs adds the mismatch metrics where
    the config does not already require them."""
    loss_fn = ClippedPGLossFn({**CONFIGS.get(name, {}), "entropy_coef": coef})
    _, values, data = logits_batch(0)
    values = values.detach() if coef > 0 else values[..., 0].detach()
    _, metrics = loss_fn(values, TrainBatch.from_transport(data), *counts(data))
    assert set(metrics) == loss_fn.METRICS | GENERATOR_METRICS
    assert ("token_entropy" in loss_fn.METRICS) == (coef > 0)
    if "generation_logprobs" in loss_fn.batch_fields():
        assert GENERATOR_METRICS <= loss_fn.METRICS
        return
    del data["generation_logprobs"]
    _, metrics = loss_fn(values, TrainBatch.from_transport(data), *counts(data))
    assert set(metrics) == loss_fn.METRICS
