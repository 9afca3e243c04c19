"""ClippedPGLossFn against a float64 reference written token by token, plus split invariance."""

import math
from pathlib import Path

import pytest
import torch

from rl_algorithms.losses import ClippedPGLossConfig, ClippedPGLossFn
from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.interfaces import Max, Min

CPU_RECIPE = Path(__file__).resolve().parents[4] / "examples" / "configs" / "grpo_math_cpu.yaml"


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
        loss_mask=token_mask.double(),
        sample_mask=sample_mask,
        advantages=adv,
        prev_logprobs=prev * real,
        generation_logprobs=gen * real,
        reference_logprobs=ref * real,
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
            t for t in range(1, int(data["input_lengths"][b])) if data["loss_mask"][b, t] == 1
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
                d = data["reference_logprobs"][b, t] - lp[b, t]
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
    # Left out, the aggregation follows the ratios: per token, or per sequence for GSPO.
    token_level = cfg.token_level_loss
    if token_level is None:
        token_level = not cfg.sequence_level_importance_ratios
    if token_level:
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
    return TrainBatch.from_transport(data).sample_valid_mask().sum(), TrainBatch.from_transport(
        data
    ).loss_token_mask().sum()


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_and_gradient_match_the_reference(name):
    cfg = ClippedPGLossConfig.model_validate(CONFIGS[name])
    lp, data = pg_batch()
    seqs, toks = global_counts(data)
    loss, metrics = ClippedPGLossFn(cfg)(lp, TrainBatch.from_transport(data), seqs, toks)
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
    plain, _ = ClippedPGLossFn({})(lp, TrainBatch.from_transport(data), one, one)
    dual, _ = ClippedPGLossFn({"ratio_clip_c": 3.0})(lp, TrainBatch.from_transport(data), one, one)
    assert plain.item() == pytest.approx(math.exp(2.0))
    assert dual.item() == pytest.approx(3.0)
    (grad,) = torch.autograd.grad(dual, lp)
    assert float(grad.abs().sum()) == 0.0


def test_metrics_report_ratios_clipping_and_generator_mismatch():
    lp, data = pg_batch()
    seqs, toks = global_counts(data)
    _, metrics = ClippedPGLossFn({})(lp, TrainBatch.from_transport(data), seqs, toks)
    mask = TrainBatch.from_transport(data).loss_token_mask().bool()
    ratio = torch.exp(lp.detach() - data["prev_logprobs"])[mask]
    assert metrics["probs_ratio"] == pytest.approx(float(ratio.mean()))
    assert metrics["probs_ratio_min"] == pytest.approx(float(ratio.min()))
    assert metrics["probs_ratio_max"] == pytest.approx(float(ratio.max()))
    outside = ((ratio < 0.8) | (ratio > 1.2)).double().mean()
    assert metrics["probs_ratio_outside_clip_range"] == pytest.approx(float(outside))
    diff = (data["prev_logprobs"] - data["generation_logprobs"])[mask].abs()
    assert metrics["token_mult_prob_error"] == pytest.approx(float(torch.exp(diff).mean()))


def test_sampled_token_entropy_is_the_mean_negative_logprob_over_loss_tokens():
    lp, data = pg_batch()
    seqs, toks = global_counts(data)
    _, metrics = ClippedPGLossFn({})(lp, TrainBatch.from_transport(data), seqs, toks)
    # Written plainly: every token of every kept sample from position 2 on (pg_batch's layout).
    total, count = 0.0, 0
    for b in range(lp.shape[0]):
        if data["sample_mask"][b] == 0:
            continue
        for t in range(2, int(data["input_lengths"][b])):
            total -= float(lp[b, t])
            count += 1
    assert metrics["sampled_token_entropy"] == pytest.approx(total / count, rel=1e-12)


def test_sampled_token_entropy_estimates_the_entropy_of_on_policy_tokens():
    """Tokens drawn from a known categorical pi: the metric converges to H(pi) = -sum p log p."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    exact = float(-(probs * probs.log()).sum())
    B, S = 400, 500
    tokens = torch.multinomial(probs, B * S, replacement=True, generator=g).view(B, S)
    lp = probs.log()[tokens]
    data = BatchedDataDict(
        input_ids=tokens + 1,
        input_lengths=torch.full((B,), S),
        advantages=torch.zeros(B, S, dtype=torch.float64),
        prev_logprobs=lp,
    )
    one_seq, toks = torch.tensor(float(B)), torch.tensor(float(B * S))
    _, metrics = ClippedPGLossFn({})(lp, TrainBatch.from_transport(data), one_seq, toks)
    # Standard error of the mean of -log pi(y): sqrt(Var / n).
    var = float((probs * probs.log().square()).sum()) - exact**2
    assert abs(metrics["sampled_token_entropy"] - exact) < 4 * math.sqrt(var / (B * S))


def test_on_policy_the_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    lp, data = pg_batch()
    data["prev_logprobs"] = lp.detach().clone()
    data["generation_logprobs"] = lp.detach().clone()
    seqs, toks = global_counts(data)
    loss, metrics = ClippedPGLossFn({})(lp, TrainBatch.from_transport(data), seqs, toks)
    assert metrics["probs_ratio_min"] == pytest.approx(1.0)
    assert metrics["probs_ratio_max"] == pytest.approx(1.0)
    assert metrics["token_mult_prob_error"] == pytest.approx(1.0)
    (grad,) = torch.autograd.grad(loss, lp)
    mask = TrainBatch.from_transport(data).loss_token_mask()
    torch.testing.assert_close(grad, -data["advantages"] * mask / mask.sum())


@pytest.mark.parametrize("name", ["defaults", "sequence-mean", "gspo-sequence", "kl-k3-clamped"])
def test_micro_batches_add_up_to_the_whole_batch(name, split_matches_whole):
    """Losses, gradients and metrics of micro-batches (global counts) equal the whole batch's."""
    lp, data = pg_batch(seed=3)
    seqs, toks = global_counts(data)
    loss_fn = ClippedPGLossFn(CONFIGS[name])
    whole_metrics, parts = split_matches_whole(
        loss_fn, lp, data, [(0, 1), (1, 4), (4, 6)], seqs, toks
    )
    additive = ("probs_ratio", "clip_fraction", "token_mult_prob_error", "kl_penalty")
    for key in (*additive, "sampled_token_entropy"):
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
        ClippedPGLossFn({})(
            lp, TrainBatch.from_transport(data), torch.tensor(1.0), torch.tensor(1.0)
        )


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
    loss, metrics = ClippedPGLossFn(cfg, pi_old_is_current=True)(
        lp, TrainBatch.from_transport(data), seqs, toks
    )
    (grad,) = torch.autograd.grad(loss, lp)
    ref_data = BatchedDataDict({**data, "prev_logprobs": lp.detach().clone()})
    expected = reference_loss(lp, ref_data, cfg)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert metrics["probs_ratio_min"] == metrics["probs_ratio_max"] == 1.0
    # Off (the default), a batch without pi_old's log-probs is an error, not a silent ratio 1.
    with pytest.raises(KeyError, match="prev_logprobs"):
        ClippedPGLossFn(cfg)(lp, TrainBatch.from_transport(data), seqs, toks)


# The default recipe's loss (KL penalty 0.01, clamped k3), and the same with both clamps off
# (allowed), where one overflowing position would turn a product mask into NaN.
RECIPE_KL = {"reference_policy_kl_penalty": 0.01}
UNCLAMPED_KL = {**RECIPE_KL, "kl_input_clamp_value": None, "kl_output_clamp_value": None}


@pytest.mark.parametrize(
    "config",
    [RECIPE_KL, UNCLAMPED_KL, {**UNCLAMPED_KL, "token_level_loss": False}],
    ids=["recipe", "unclamped", "unclamped-sequence-mean"],
)
def test_a_sample_with_sample_mask_0_is_inert(config):
    """Dynamic sampling's filler groups (``sample_mask`` 0): no policy-gradient, no KL gradient
    and no share of the global token or sample count, whatever their advantages and log-probs."""
    cfg = ClippedPGLossConfig.model_validate(config)
    lp, real = pg_batch(seed=5)
    B, S = lp.shape
    filler = 2
    g = torch.Generator().manual_seed(6)
    extra = {
        "input_ids": torch.randint(1, 50, (filler, S), generator=g),
        "input_lengths": torch.full((filler,), S),
        "loss_mask": torch.ones(filler, S, dtype=torch.float64),
        "sample_mask": torch.zeros(filler),
        "advantages": torch.full((filler, S), 1.7, dtype=torch.float64),  # e.g. whitened 0s
        "prev_logprobs": torch.full((filler, S), -1.0, dtype=torch.float64),
        "generation_logprobs": torch.full((filler, S), -1.0, dtype=torch.float64),
        # log pi_ref - log pi = 1000 on the filler's tokens: exp overflows even in float64
        "reference_logprobs": torch.full((filler, S), -1.0, dtype=torch.float64),
    }
    data = BatchedDataDict({k: torch.cat([real[k], extra[k]]) for k in real})
    filler_lp = torch.full((filler, S), -1001.0, dtype=torch.float64)
    all_lp = torch.cat([lp.detach(), filler_lp]).requires_grad_(True)

    # The counts the policy worker divides by (it counts them with these same masks).
    seqs, toks = global_counts(data)
    real_seqs, real_toks = global_counts(real)
    assert (seqs, toks) == (real_seqs, real_toks)

    loss, metrics = ClippedPGLossFn(cfg)(all_lp, TrainBatch.from_transport(data), seqs, toks)
    (grad,) = torch.autograd.grad(loss, all_lp)
    expected = reference_loss(lp, real, cfg)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad[:B], expected_grad, rtol=1e-9, atol=1e-12)
    assert torch.equal(grad[B:], torch.zeros(filler, S, dtype=torch.float64))
    _, real_metrics = ClippedPGLossFn(cfg)(
        lp, TrainBatch.from_transport(real), real_seqs, real_toks
    )
    for key in ("kl_penalty", "clip_fraction", "probs_ratio"):
        assert metrics[key] == pytest.approx(real_metrics[key], rel=1e-12), key


def test_an_overflowing_prompt_position_gives_no_nan():
    """A backend that passes every position's log-prob (Megatron) with the KL clamps off: at a
    prompt token where log pi_ref - log pi = 95 > ~88.7, exp overflows float32. The masked-out
    position must not reach the loss or the gradient."""
    cfg = ClippedPGLossConfig.model_validate(UNCLAMPED_KL)
    lp64, data = pg_batch(seed=2)
    lp64 = lp64.detach()
    assert data["loss_mask"][0, 1] == 0  # position 1 of sample 0 is a prompt token
    lp64[0, 1] = -100.0
    data["reference_logprobs"][0, 1] = -5.0
    data32 = BatchedDataDict(
        {k: v.float() if v.is_floating_point() else v for k, v in data.items()}
    )
    lp32 = lp64.float().requires_grad_(True)
    seqs, toks = global_counts(data32)
    loss, metrics = ClippedPGLossFn(cfg)(lp32, TrainBatch.from_transport(data32), seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp32)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for k, v in metrics.items() if not k.endswith(("_min", "_max")))

    lp_ref = lp64.clone().requires_grad_(True)
    expected = reference_loss(lp_ref, data, cfg)
    (expected_grad,) = torch.autograd.grad(expected, lp_ref)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-7)
    mask = TrainBatch.from_transport(data32).loss_token_mask() > 0
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))


def test_clip_fraction_counts_tokens_whose_clipped_branch_is_active():
    """The standard metric (TRL's clip ratio, veRL's pg_clipfrac): a token counts when its ratio
    is beyond the clip range on the side that the advantage's sign makes binding, i.e. where
    the clipped term is the larger loss. A ratio above the range with a negative advantage is
    not clipped; it is reported apart, as ``probs_ratio_outside_clip_range``."""
    lp, data = pg_batch()
    seqs, toks = global_counts(data)
    _, metrics = ClippedPGLossFn({"ratio_clip_min": 0.1, "ratio_clip_max": 0.3})(
        lp, TrainBatch.from_transport(data), seqs, toks
    )
    mask = TrainBatch.from_transport(data).loss_token_mask().bool()
    ratio = torch.exp(lp.detach() - data["prev_logprobs"])[mask]
    adv = data["advantages"][mask]
    active = ((ratio > 1.3) & (adv > 0)) | ((ratio < 0.9) & (adv < 0))
    outside = (ratio > 1.3) | (ratio < 0.9)
    assert active.sum() < outside.sum()  # the batch tells the two apart
    assert metrics["clip_fraction"] == pytest.approx(float(active.double().mean()))
    assert metrics["probs_ratio_outside_clip_range"] == pytest.approx(
        float(outside.double().mean())
    )


def gspo_reference(lp, data, eps_low, eps_high):
    """The GSPO paper's objective, negated: the mean over sequences (each weighs the same) of
    min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), where s_i is the geometric mean of
    the sequence's token ratios."""
    terms = []
    for b in range(lp.shape[0]):
        if data["sample_mask"][b] == 0:
            continue
        tokens = [
            t for t in range(1, int(data["input_lengths"][b])) if data["loss_mask"][b, t] == 1
        ]
        log_s = sum(lp[b, t] - data["prev_logprobs"][b, t] for t in tokens) / len(tokens)
        s = torch.exp(log_s)
        a = float(data["advantages"][b, tokens[0]])
        terms.append(torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a))
    return -sum(terms) / len(terms)


def test_gspo_weights_sequences_equally_by_default():
    cfg = ClippedPGLossConfig(sequence_level_importance_ratios=True)
    lp, data = pg_batch(seed=4)
    # GSPO's advantage is one per sequence.
    data["advantages"] = data["advantages"][:, :1].expand_as(data["advantages"]).clone()
    lengths = TrainBatch.from_transport(data).loss_token_mask().sum(1)
    assert len(set(lengths[data["sample_mask"] > 0].tolist())) > 1  # lengths differ
    seqs, toks = global_counts(data)
    loss, _ = ClippedPGLossFn(cfg)(lp, TrainBatch.from_transport(data), seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp)
    expected = gspo_reference(lp, data, 0.2, 0.2)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert cfg.token_level is False  # the paper's aggregation
    assert ClippedPGLossConfig().token_level is True  # GRPO's default is unchanged
    # The other choice (each sequence weighted by its length) stays available when asked for.
    both = {"sequence_level_importance_ratios": True, "token_level_loss": True}
    assert ClippedPGLossConfig.model_validate(both).token_level is True


def test_the_recipe_gives_gspo_the_papers_aggregation():
    from rl_algorithms import cli

    grpo = cli.load_algorithm("grpo")
    # The tiny CPU recipe on top of the default one (the main job's needs the dev group's model
    # package); validation reads no tokenizer.
    base = ["--config", str(CPU_RECIPE), "tokenizer.path=/tokenizer"]
    gspo = cli.build_config(grpo, [*base, "loss_fn.sequence_level_importance_ratios=true"])
    assert gspo.loss_fn.token_level is False
    assert cli.build_config(grpo, base).loss_fn.token_level is True
    chosen = ["loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=true"]
    assert cli.build_config(grpo, [*base, *chosen]).loss_fn.token_level is True


def test_ratio_extremes_are_declared_min_and_max_and_the_means_plain():
    lp, data = pg_batch()
    _, metrics = ClippedPGLossFn({})(lp, TrainBatch.from_transport(data), *global_counts(data))
    assert isinstance(metrics["probs_ratio_min"], Min)
    assert isinstance(metrics["probs_ratio_max"], Max)
    assert type(metrics["probs_ratio"]) is float
