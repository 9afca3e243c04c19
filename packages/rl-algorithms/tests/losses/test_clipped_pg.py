"""ClippedPGLossFn against a float64 reference written token by token, plus split invariance."""

import math

import pytest
import torch

from rl_algorithms.losses import ClippedPGLossConfig, ClippedPGLossFn
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.losses import loss_token_mask, sample_valid_mask


def pg_batch(seed: int = 0) -> tuple[torch.Tensor, BatchedDataDict]:
    """Current log-probs (a leaf with grad) and a batch whose ratios fall on both clip sides."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 9, 4, 9, 7, 3])
    B, S = len(lengths), 9
    real = torch.arange(S)[None, :] < lengths[:, None]
    logprobs = (-torch.rand(B, S, generator=g, dtype=torch.float64) * 3) * real
    prev = logprobs + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.4
    gen = prev + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.2
    ref = logprobs + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone()
    adv[1, 5] = -2.5  # a per-token advantage, and a negative one where the ratio is big
    prev[1, 5] = logprobs[1, 5] - 2.0
    token_mask = (torch.arange(S)[None, :] >= 2) & real  # "response": from position 2 on
    sample_mask = torch.tensor([1.0, 1, 1, 0, 1, 1])  # sample 3 is dropped
    data = BatchedDataDict(
        input_ids=torch.randint(1, 50, (B, S), generator=g) * real,
        input_lengths=lengths,
        token_mask=token_mask.double(),
        sample_mask=sample_mask,
        advantages=adv,
        prev_logprobs=prev * real,
        generation_logprobs=gen * real,
        reference_policy_logprobs=ref * real,
    )
    return logprobs.requires_grad_(True), data


def reference_loss(lp: torch.Tensor, data: BatchedDataDict, cfg: ClippedPGLossConfig):
    """The loss written plainly: a loop over samples and their loss tokens."""
    per_sample_losses, token_losses, n_samples = [], [], 0
    for b in range(lp.shape[0]):
        if data["sample_mask"][b] == 0:
            continue
        n_samples += 1
        tokens = [
            t for t in range(1, int(data["input_lengths"][b])) if data["token_mask"][b, t] == 1
        ]
        prev, gen = data["prev_logprobs"][b], data["generation_logprobs"][b]
        seq_log_ratio = sum(lp[b, t] - prev[t] for t in tokens) / max(len(tokens), 1)
        seq_is = sum(prev[t] - gen[t] for t in tokens) / max(len(tokens), 1)
        losses = []
        for t in tokens:
            adv = float(data["advantages"][b, t])
            if cfg.sequence_level_importance_ratios:
                ratio = torch.exp(seq_log_ratio)
            else:
                ratio = torch.exp(lp[b, t] - prev[t])
            lo, hi = 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max
            clipped = torch.clamp(ratio, lo, hi)
            loss = torch.maximum(-adv * ratio, -adv * clipped)
            if cfg.ratio_clip_c is not None and adv < 0:
                loss = torch.minimum(loss, torch.tensor(-adv * cfg.ratio_clip_c, dtype=lp.dtype))
            if cfg.use_importance_sampling_correction:
                w = math.exp(
                    float(seq_is if cfg.sequence_level_importance_ratios else prev[t] - gen[t])
                )
                if cfg.truncated_importance_sampling_ratio is not None:
                    w = min(w, cfg.truncated_importance_sampling_ratio)
                loss = loss * w
            if cfg.reference_policy_kl_penalty:
                d = data["reference_policy_logprobs"][b, t] - lp[b, t]
                if cfg.kl_input_clamp_value is not None:
                    d = torch.clamp(d, -cfg.kl_input_clamp_value, cfg.kl_input_clamp_value)
                kl = {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - d - 1}[
                    cfg.reference_policy_kl_type
                ]
                if cfg.kl_output_clamp_value is not None:
                    kl = torch.clamp(kl, -cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
                if cfg.use_on_policy_kl_approximation:
                    kl = kl * math.exp((lp[b, t] - gen[t]).item())
                loss = loss + cfg.reference_policy_kl_penalty * kl
            losses.append(loss)
        token_losses.extend(losses)
        if losses:
            per_sample_losses.append(sum(losses) / len(losses))
    if cfg.token_level_loss:
        return sum(token_losses) / len(token_losses)
    return sum(per_sample_losses) / n_samples


CONFIGS = {
    "defaults": {},
    "asymmetric+dual": {"ratio_clip_min": 0.1, "ratio_clip_max": 0.3, "ratio_clip_c": 3.0},
    "kl-k1": {"reference_policy_kl_penalty": 0.3, "reference_policy_kl_type": "k1"},
    "kl-k2": {"reference_policy_kl_penalty": 0.3, "reference_policy_kl_type": "k2"},
    "kl-k3-clamped": {
        "reference_policy_kl_penalty": 0.3,
        "kl_input_clamp_value": 0.4,
        "kl_output_clamp_value": 0.05,
    },
    "kl-on-policy": {"reference_policy_kl_penalty": 0.2, "use_on_policy_kl_approximation": True},
    "is-token": {"use_importance_sampling_correction": True},
    "is-token-truncated": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_ratio": 1.1,
    },
    "gspo-sequence": {
        "sequence_level_importance_ratios": True,
        "use_importance_sampling_correction": True,
        "token_level_loss": False,
    },
    "sequence-mean": {"token_level_loss": False, "reference_policy_kl_penalty": 0.1},
}


def global_counts(data):
    return sample_valid_mask(data).sum(), loss_token_mask(data).sum()


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_and_gradient_match_the_reference(name):
    cfg = ClippedPGLossConfig.model_validate(CONFIGS[name])
    lp, data = pg_batch()
    seqs, toks = global_counts(data)
    loss, metrics = ClippedPGLossFn(cfg)(lp, data, seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp)
    expected = reference_loss(lp, data, cfg)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert metrics["loss"] == pytest.approx(loss.item())


def test_dual_clip_caps_the_loss_of_a_negative_advantage():
    # A = -1 and ratio = e^2 ~ 7.4: plain clipping leaves -A * ratio = 7.4; the dual clip caps
    # it at -A * c = 3, and the capped token has no gradient.
    lp = torch.tensor([[0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    data = BatchedDataDict(
        input_ids=torch.tensor([[1, 2]]),
        input_lengths=torch.tensor([2]),
        advantages=torch.tensor([[-1.0, -1.0]], dtype=torch.float64),
        prev_logprobs=torch.tensor([[0.0, -3.0]], dtype=torch.float64),
    )
    one = torch.tensor(1.0)
    plain, _ = ClippedPGLossFn({})(lp, data, one, one)
    dual, _ = ClippedPGLossFn({"ratio_clip_c": 3.0})(lp, data, one, one)
    assert plain.item() == pytest.approx(math.exp(2.0))
    assert dual.item() == pytest.approx(3.0)
    (grad,) = torch.autograd.grad(dual, lp)
    assert float(grad.abs().sum()) == 0.0


def test_metrics_report_ratios_clipping_and_generator_mismatch():
    lp, data = pg_batch()
    seqs, toks = global_counts(data)
    _, metrics = ClippedPGLossFn({})(lp, data, seqs, toks)
    mask = loss_token_mask(data).bool()
    ratio = torch.exp(lp.detach() - data["prev_logprobs"])[mask]
    assert metrics["probs_ratio"] == pytest.approx(float(ratio.mean()))
    assert metrics["probs_ratio_min"] == pytest.approx(float(ratio.min()))
    assert metrics["probs_ratio_max"] == pytest.approx(float(ratio.max()))
    outside = ((ratio < 0.8) | (ratio > 1.2)).double().mean()
    assert metrics["clip_fraction"] == pytest.approx(float(outside))
    diff = (data["prev_logprobs"] - data["generation_logprobs"])[mask].abs()
    assert metrics["token_mult_prob_error"] == pytest.approx(float(torch.exp(diff).mean()))


def test_on_policy_the_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    lp, data = pg_batch()
    data["prev_logprobs"] = lp.detach().clone()
    data["generation_logprobs"] = lp.detach().clone()
    seqs, toks = global_counts(data)
    loss, metrics = ClippedPGLossFn({})(lp, data, seqs, toks)
    assert metrics["probs_ratio_min"] == pytest.approx(1.0)
    assert metrics["probs_ratio_max"] == pytest.approx(1.0)
    assert metrics["token_mult_prob_error"] == pytest.approx(1.0)
    (grad,) = torch.autograd.grad(loss, lp)
    mask = loss_token_mask(data)
    torch.testing.assert_close(grad, -data["advantages"] * mask / mask.sum())


@pytest.mark.parametrize("name", ["defaults", "sequence-mean", "gspo-sequence", "kl-k3-clamped"])
def test_micro_batches_add_up_to_the_whole_batch(name):
    """Losses, gradients and metrics of micro-batches (global counts) equal the whole batch's."""
    lp, data = pg_batch(seed=3)
    seqs, toks = global_counts(data)
    loss_fn = ClippedPGLossFn(CONFIGS[name])
    whole, whole_metrics = loss_fn(lp, data, seqs, toks)
    (whole_grad,) = torch.autograd.grad(whole, lp)

    total, parts = 0.0, []
    for start, end in [(0, 1), (1, 4), (4, 6)]:
        part, m = loss_fn(lp[start:end], data.slice(start, end), seqs, toks)
        total = total + part
        parts.append(m)
    (split_grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-14)
    for key in ("probs_ratio", "clip_fraction", "token_mult_prob_error", "kl_penalty"):
        assert sum(m[key] for m in parts) == pytest.approx(whole_metrics[key], rel=1e-10)
    assert min(m["probs_ratio_min"] for m in parts) == whole_metrics["probs_ratio_min"]
    assert max(m["probs_ratio_max"] for m in parts) == whole_metrics["probs_ratio_max"]


def test_bad_config_and_missing_keys_are_named():
    with pytest.raises(ValueError, match="ratio_clip_c"):
        ClippedPGLossConfig(ratio_clip_c=0.5)
    with pytest.raises(ValueError, match="use_importance_sampling_correction"):
        ClippedPGLossConfig(truncated_importance_sampling_ratio=2.0)
    lp, data = pg_batch()
    del data["prev_logprobs"]
    with pytest.raises(KeyError, match="prev_logprobs"):
        ClippedPGLossFn({})(lp, data, torch.tensor(1.0), torch.tensor(1.0))


@pytest.mark.parametrize(
    "name", ["defaults", "kl-k3-clamped", "is-token-truncated", "gspo-sequence"]
)
def test_without_prev_logprobs_pi_old_is_the_current_policy(name):
    """One optimiser step per batch: the loss is scored against the detached current
    log-probs, which is the reference computed with ``prev_logprobs = logprobs`` (float64)."""
    cfg = ClippedPGLossConfig.model_validate(CONFIGS[name])
    lp, data = pg_batch(seed=3)
    del data["prev_logprobs"]
    seqs, toks = global_counts(data)
    loss, metrics = ClippedPGLossFn(cfg, pi_old_is_current=True)(lp, data, seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp)
    ref_data = BatchedDataDict({**data, "prev_logprobs": lp.detach().clone()})
    expected = reference_loss(lp, ref_data, cfg)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert metrics["probs_ratio_min"] == metrics["probs_ratio_max"] == 1.0
    # Off (the default), a batch without pi_old's log-probs is an error, not a silent ratio 1.
    with pytest.raises(KeyError, match="prev_logprobs"):
        ClippedPGLossFn(cfg)(lp, data, seqs, toks)
