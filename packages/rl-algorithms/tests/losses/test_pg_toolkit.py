"""CISPO, SAPO, the mismatch corrections and Dr. GRPO's normaliser against float64 references
written from the papers' per-token formulas (a plain loop over samples and tokens)."""

import math

import pytest
import torch

from rl_algorithms.losses import ClippedPGLossConfig, ClippedPGLossFn
from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict

SEEDS = [0, 1, 2]


def toolkit_batch(seed: int) -> tuple[torch.Tensor, BatchedDataDict]:
    """Padded rows with a 2-token prompt, a dropped sample, per-sequence advantages with one
    per-token exception, ratios on both sides of the clip range, and a generator whose log-probs
    drift from the trainer's per sequence (so sequence masks fire) and per token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 10, 4, 10, 8, 5, 9])
    B, S = len(lengths), 10
    real = torch.arange(S)[None, :] < lengths[:, None]
    lp = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    prev = lp + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.4
    drift = torch.randn(B, 1, generator=g, dtype=torch.float64) * 0.3
    gen = prev + drift + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.25
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone()
    adv[1, 6] = -1.5
    # Garbage on padding: a loss must never read it.
    lp, prev, gen = (torch.where(real, x, torch.full_like(x, -1e4)) for x in (lp, prev, gen))
    data = BatchedDataDict(
        input_ids=torch.randint(1, 50, (B, S), generator=g) * real,
        input_lengths=lengths,
        loss_mask=((torch.arange(S)[None, :] >= 2) & real).double(),
        sample_mask=torch.tensor([1.0, 1, 1, 0, 1, 1, 1]),
        advantages=adv,
        prev_logprobs=prev,
        generation_logprobs=gen,
    )
    return lp.requires_grad_(True), data


def loss_tokens(data, b):
    if data["sample_mask"][b] == 0:
        return []
    return [t for t in range(1, int(data["input_lengths"][b])) if data["loss_mask"][b, t] == 1]


def reference(lp, data, c: dict):
    """The loss written from the formulas, token by token (``c`` is the config dict)."""
    lo_clip, hi_clip = c.get("ratio_clip_min", 0.2), c.get("ratio_clip_max", 0.2)
    seq_ratios = c.get("sequence_level_importance_ratios", False)
    all_terms, sample_means, n_samples = [], [], 0
    for b in range(lp.shape[0]):
        if data["sample_mask"][b] == 0:
            continue
        n_samples += 1
        toks = loss_tokens(data, b)
        prev, gen = data["prev_logprobs"][b], data["generation_logprobs"][b]
        n = max(len(toks), 1)
        seq_log_r = sum((lp[b, t] - prev[t] for t in toks), torch.tensor(0.0)) / n
        seq_log_w = sum(float(prev[t] - gen[t]) for t in toks) / n
        drift = sum(float(gen[t] - lp[b, t].detach()) for t in toks) / n
        terms = []
        for t in toks:
            a = float(data["advantages"][b, t])
            r = torch.exp(seq_log_r) if seq_ratios else torch.exp(lp[b, t] - prev[t])
            if c.get("use_cispo"):
                # MiniMax-M1: sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi, negated.
                w_clip = min(max(float(r.detach()), 1 - lo_clip), 1 + hi_clip)
                term = -w_clip * a * lp[b, t]
            elif c.get("use_sapo"):
                # SAPO: f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau by the advantage's sign.
                tau = c.get("sapo_tau_pos", 1.0) if a > 0 else c.get("sapo_tau_neg", 1.05)
                term = -a * torch.sigmoid(tau * (r - 1)) * 4 / tau
            else:
                term = torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo_clip, 1 + hi_clip))
            if c.get("use_importance_sampling_correction"):
                w = math.exp(seq_log_w if seq_ratios else float(prev[t] - gen[t]))
                hi = c.get("truncated_importance_sampling_ratio")
                lo = c.get("truncated_importance_sampling_ratio_min")
                kind = c.get("truncated_importance_sampling_type", "tis")
                if hi is not None and kind == "tis":
                    w = min(max(w, lo or 0.0), hi)
                # IcePop judges the token's own weight, seq-mask-tis the sequence's mean.
                judged = {"icepop": w, "seq-mask-tis": math.exp(seq_log_w)}.get(kind)
                if judged is not None and not lo <= judged <= hi:
                    w = 0.0
                term = term * w
            delta = c.get("off_policy_sequence_mask_delta")
            if delta is not None and a < 0 and drift > delta:
                term = term * 0.0
            terms.append(term)
        all_terms.extend(terms)
        if terms:
            sample_means.append(sum(terms) / len(terms))
    if c.get("constant_length_normalizer") is not None:
        return sum(all_terms) / (n_samples * c["constant_length_normalizer"])
    token_level = c.get("token_level_loss", not seq_ratios)
    if token_level:
        return sum(all_terms) / len(all_terms)
    return sum(sample_means) / n_samples


def counts(data):
    batch = TrainBatch.from_transport(data)
    return batch.sample_valid_mask().sum(), batch.loss_token_mask().sum()


ICEPOP = {
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "icepop",
    "truncated_importance_sampling_ratio": 1.25,
    "truncated_importance_sampling_ratio_min": 0.8,
}
SEQ_MASK = {
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "seq-mask-tis",
    "truncated_importance_sampling_ratio": 1.1,
    "truncated_importance_sampling_ratio_min": 0.9,
}
OFF_POLICY = {"off_policy_sequence_mask_delta": 0.05}
# MiniMax-M1 clips the weight above only (ratio_clip_min 1: a lower bound of 0).
CISPO = {"use_cispo": True, "ratio_clip_min": 1.0, "ratio_clip_max": 0.28}
CONFIGS = {
    "cispo": CISPO,
    "cispo-two-sided": {"use_cispo": True, "ratio_clip_min": 0.2, "ratio_clip_max": 0.3},
    "sapo": {"use_sapo": True},
    "sapo-temperatures": {"use_sapo": True, "sapo_tau_pos": 0.5, "sapo_tau_neg": 2.0},
    "sapo-sequence-mean": {"use_sapo": True, "token_level_loss": False},
    "tis-two-sided": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.2,
        "truncated_importance_sampling_ratio_min": 0.9,
    },
    "icepop": ICEPOP,
    "icepop-gspo": {**ICEPOP, "sequence_level_importance_ratios": True},
    "seq-mask-tis": SEQ_MASK,
    "off-policy-mask": OFF_POLICY,
    "cispo+icepop+off-policy": {**CISPO, **ICEPOP, **OFF_POLICY},
    "sapo+seq-mask+off-policy": {"use_sapo": True, **SEQ_MASK, **OFF_POLICY},
    "dr-grpo": {"constant_length_normalizer": 16.0},
    "dr-grpo+icepop": {"constant_length_normalizer": 16.0, **ICEPOP},
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_loss_and_gradient_match_the_formula(name, seed):
    lp, data = toolkit_batch(seed)
    seqs, toks = counts(data)
    loss, metrics = ClippedPGLossFn(CONFIGS[name])(lp, TrainBatch.from_transport(data), seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp)
    expected = reference(lp, data, CONFIGS[name])
    (expected_grad,) = torch.autograd.grad(expected, lp)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert torch.isfinite(grad).all()
    assert metrics["loss"] == pytest.approx(loss.item())


def test_the_batches_exercise_every_mask():
    """The masks of the reference test above fire on some tokens and sequences, not all."""
    for name, key in [
        ("icepop", "is_oob_ratio"),
        ("seq-mask-tis", "is_oob_ratio"),
        ("off-policy-mask", "off_policy_masked_seq_fraction"),
    ]:
        fractions = []
        for seed in SEEDS:
            lp, data = toolkit_batch(seed)
            _, m = ClippedPGLossFn(CONFIGS[name])(
                lp, TrainBatch.from_transport(data), *counts(data)
            )
            fractions.append(m[key])
        assert max(fractions) > 0 and min(fractions) < 1, (name, fractions)


def test_cispo_keeps_a_gradient_on_every_token_and_ppo_does_not():
    lp, data = toolkit_batch(0)
    seqs, toks = counts(data)
    mask = TrainBatch.from_transport(data).loss_token_mask() > 0
    adv_nonzero = data["advantages"] != 0
    ppo, _ = ClippedPGLossFn({})(lp, TrainBatch.from_transport(data), seqs, toks)
    cispo, m = ClippedPGLossFn(CONFIGS["cispo-two-sided"])(
        lp, TrainBatch.from_transport(data), seqs, toks
    )
    (g_ppo,) = torch.autograd.grad(ppo, lp)
    (g_cispo,) = torch.autograd.grad(cispo, lp)
    assert (g_ppo[mask & adv_nonzero] == 0).any()  # PPO drops its clipped tokens
    assert (g_cispo[mask & adv_nonzero] != 0).all()
    assert (g_cispo[~mask] == 0).all()
    assert 0 < m["clip_fraction"] < 1


@pytest.mark.parametrize("name, lo, hi", [("cispo", 0.0, 1.28), ("cispo-two-sided", 0.8, 1.3)])
def test_cispo_clip_fraction_counts_the_clipped_weights(name, lo, hi):
    """Under CISPO a token is clipped where its weight left [lo, hi], whatever A's sign."""
    lp, data = toolkit_batch(2)
    _, m = ClippedPGLossFn(CONFIGS[name])(lp, TrainBatch.from_transport(data), *counts(data))
    clipped, n = 0, 0
    for b in range(lp.shape[0]):
        for t in loss_tokens(data, b):
            r = math.exp(float(lp[b, t].detach() - data["prev_logprobs"][b, t]))
            clipped += not lo <= r <= hi
            n += 1
    assert clipped > 0
    assert m["clip_fraction"] == pytest.approx(clipped / n)
    assert m["probs_ratio_outside_clip_range"] == pytest.approx(clipped / n)


@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.3, 3.0)])
def test_sapo_on_policy_is_the_plain_policy_gradient(taus):
    """At r = 1 the gate's gradient scale 4 p (1 - p) is 1: the gradient is -A grad log pi."""
    lp, data = toolkit_batch(1)
    data["prev_logprobs"] = lp.detach().clone()
    seqs, toks = counts(data)
    cfg = {"use_sapo": True, "sapo_tau_pos": taus[0], "sapo_tau_neg": taus[1]}
    loss, m = ClippedPGLossFn(cfg)(lp, TrainBatch.from_transport(data), seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp)
    mask = TrainBatch.from_transport(data).loss_token_mask()
    torch.testing.assert_close(grad, -data["advantages"] * mask / mask.sum())
    assert m["sapo_gate_weight"] == pytest.approx(1.0)
    assert m["clip_fraction"] == 0.0


def test_sapo_gate_weight_is_the_mean_sigmoid_derivative():
    lp, data = toolkit_batch(2)
    _, m = ClippedPGLossFn(CONFIGS["sapo-temperatures"])(
        lp, TrainBatch.from_transport(data), *counts(data)
    )
    total, n = 0.0, 0
    for b in range(lp.shape[0]):
        for t in loss_tokens(data, b):
            a = float(data["advantages"][b, t])
            tau = 0.5 if a > 0 else 2.0
            p = 1 / (
                1
                + math.exp(
                    -tau * (math.exp(float(lp[b, t].detach() - data["prev_logprobs"][b, t])) - 1)
                )
            )
            total += 4 * p * (1 - p)
            n += 1
    assert m["sapo_gate_weight"] == pytest.approx(total / n, rel=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_metrics_match_a_plain_count(seed):
    lp, data = toolkit_batch(seed)
    cfg = {**ICEPOP, **OFF_POLICY}
    _, m = ClippedPGLossFn(cfg)(lp, TrainBatch.from_transport(data), *counts(data))
    prev, gen = data["prev_logprobs"], data["generation_logprobs"]
    k1, k3, oob, off_tok, off_seq, n_tok, n_seq = [], [], 0, 0, 0, 0, 0
    for b in range(lp.shape[0]):
        toks = loss_tokens(data, b)
        if data["sample_mask"][b] == 0:
            continue
        n_seq += 1
        drift = sum(float(gen[b, t] - lp[b, t].detach()) for t in toks) / max(len(toks), 1)
        hit = False
        for t in toks:
            n_tok += 1
            d = float(prev[b, t] - gen[b, t])  # log pi_train - log pi_gen
            k1.append(-d)
            k3.append(math.exp(d) - d - 1)
            oob += not 0.8 <= math.exp(d) <= 1.25
            if float(data["advantages"][b, t]) < 0 and drift > 0.05:
                off_tok += 1
                hit = True
        off_seq += hit
    assert m["gen_train_kl_k1"] == pytest.approx(sum(k1) / n_tok, rel=1e-10)
    assert m["gen_train_kl_k3"] == pytest.approx(sum(k3) / n_tok, rel=1e-10)
    assert float(m["gen_train_kl_k1_max"]) == pytest.approx(max(k1), rel=1e-12)
    assert float(m["gen_train_kl_k3_max"]) == pytest.approx(max(k3), rel=1e-12)
    assert m["is_oob_ratio"] == pytest.approx(oob / n_tok)
    assert m["off_policy_masked_token_fraction"] == pytest.approx(off_tok / n_tok)
    assert m["off_policy_masked_seq_fraction"] == pytest.approx(off_seq / n_seq)


def test_off_policy_mask_drops_only_negative_advantages():
    """Every sequence drifts past delta; only the tokens with A < 0 go (A = 0 and A > 0 stay)."""
    lp, data = toolkit_batch(0)
    data["advantages"][5] = 0.0
    data["generation_logprobs"] = lp.detach() + 1.0  # mean log pi_gen - log pi = 1 > 0.05
    _, m = ClippedPGLossFn(OFF_POLICY)(lp, TrainBatch.from_transport(data), *counts(data))
    negative, seqs, n_tok, n_seq = 0, 0, 0, 0
    for b in range(lp.shape[0]):
        if data["sample_mask"][b] == 0:
            continue
        toks = loss_tokens(data, b)
        hits = sum(float(data["advantages"][b, t]) < 0 for t in toks)
        negative, seqs = negative + hits, seqs + (hits > 0)
        n_tok, n_seq = n_tok + len(toks), n_seq + 1
    assert 0 < negative < n_tok
    assert m["off_policy_masked_token_fraction"] == pytest.approx(negative / n_tok)
    assert m["off_policy_masked_seq_fraction"] == pytest.approx(seqs / n_seq)


def test_seq_mask_tis_reports_the_fraction_of_sequences():
    lp, data = toolkit_batch(0)
    _, m = ClippedPGLossFn(SEQ_MASK)(lp, TrainBatch.from_transport(data), *counts(data))
    prev, gen = data["prev_logprobs"], data["generation_logprobs"]
    out, n = 0, 0
    for b in range(lp.shape[0]):
        if data["sample_mask"][b] == 0:
            continue
        toks = loss_tokens(data, b)
        g = math.exp(sum(float(prev[b, t] - gen[b, t]) for t in toks) / max(len(toks), 1))
        out += not 0.9 <= g <= 1.1
        n += 1
    assert m["is_oob_ratio"] == pytest.approx(out / n)


def test_dr_grpo_gradient_does_not_depend_on_length():
    """Each token's gradient is -A / (samples * C) on-policy, whatever its sequence's length."""
    lp, data = toolkit_batch(0)
    data["prev_logprobs"] = lp.detach().clone()
    seqs, toks = counts(data)
    loss, _ = ClippedPGLossFn({"constant_length_normalizer": 16.0})(
        lp, TrainBatch.from_transport(data), seqs, toks
    )
    (grad,) = torch.autograd.grad(loss, lp)
    mask = TrainBatch.from_transport(data).loss_token_mask()
    torch.testing.assert_close(grad, -data["advantages"] * mask / (seqs * 16.0))


@pytest.mark.parametrize(
    "name", ["cispo+icepop+off-policy", "sapo+seq-mask+off-policy", "dr-grpo+icepop"]
)
def test_micro_batches_add_up_to_the_whole_batch(name, split_matches_whole):
    lp, data = toolkit_batch(1)
    seqs, toks = counts(data)
    loss_fn = ClippedPGLossFn(CONFIGS[name])
    whole_m, parts = split_matches_whole(loss_fn, lp, data, [(0, 2), (2, 5), (5, 7)], seqs, toks)
    additive = [
        k
        for k in whole_m
        if k.endswith(("_fraction", "_ratio", "_weight"))
        or k in ("gen_train_kl_k1", "gen_train_kl_k3")
    ]
    assert additive
    for key in additive:
        assert sum(m[key] for m in parts) == pytest.approx(whole_m[key], rel=1e-10), key
    assert max(float(m["gen_train_kl_k3_max"]) for m in parts) == float(
        whole_m["gen_train_kl_k3_max"]
    )


def test_new_options_off_change_nothing():
    lp, data = toolkit_batch(0)
    seqs, toks = counts(data)
    _, old_m = ClippedPGLossFn({"use_importance_sampling_correction": True})(
        lp, TrainBatch.from_transport(data), seqs, toks
    )
    assert "is_oob_ratio" not in old_m and "sapo_gate_weight" not in old_m
    assert not any(k.startswith("off_policy") for k in old_m)
    # The TIS cap without a type is the clamp it always was (tis with min 0).
    cap = {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 1.1}
    a, _ = ClippedPGLossFn(cap)(lp, TrainBatch.from_transport(data), seqs, toks)
    b, _ = ClippedPGLossFn({**cap, "truncated_importance_sampling_type": "tis"})(
        lp, TrainBatch.from_transport(data), seqs, toks
    )
    assert a.item() == b.item()


def test_off_policy_mask_reads_the_generators_logprobs():
    fn = ClippedPGLossFn(OFF_POLICY)
    assert "generation_logprobs" in fn.batch_fields()
    lp, data = toolkit_batch(0)
    del data["generation_logprobs"]
    with pytest.raises(KeyError, match="generation_logprobs"):
        fn(lp, TrainBatch.from_transport(data), *counts(data))


@pytest.mark.parametrize(
    "config, match",
    [
        ({"use_cispo": True, "use_sapo": True}, "pick one"),
        ({"use_cispo": True, "ratio_clip_c": 3.0}, "ratio_clip_c .* not use_cispo"),
        ({"use_cispo": True, "sequence_level_importance_ratios": True}, "use_cispo .* sequence_"),
        ({"use_sapo": True, "sequence_level_importance_ratios": True}, "use_sapo .* sequence_"),
        ({"use_sapo": True, "ratio_clip_c": 3.0}, "ratio_clip_c .* not use_sapo"),
        ({"use_cispo": True, "ratio_clip_min": 1.5}, "ratio_clip_min must be <= 1 with use_cispo"),
        ({"off_policy_sequence_mask_delta": -0.1}, "off_policy_sequence_mask_delta"),
        ({"use_cispo": True, "token_level_loss": False}, "token-level"),
        ({"ratio_clip_min": 1.0}, "ratio_clip_min"),
        ({"use_sapo": True, "sapo_tau_neg": 0.0}, "sapo_tau_neg"),
        ({**ICEPOP, "truncated_importance_sampling_ratio_min": None}, "needs truncated_imp"),
        ({**ICEPOP, "truncated_importance_sampling_ratio": None}, "_ratio_min need trunc"),
        # A band without 1 would drop (or rescale) every token of a run with no mismatch.
        ({**ICEPOP, "truncated_importance_sampling_ratio_min": 2.0}, r"must hold 1 .* \[2.0, "),
        ({**ICEPOP, "truncated_importance_sampling_ratio": 0.9}, r"must hold 1 .*, 0.9\]"),
        ({**SEQ_MASK, "truncated_importance_sampling_ratio_min": 1.5}, "must hold 1"),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_ratio": 0.5,
            },
            r"must hold 1 .* \[None, 0.5\]",
        ),
        # Keys the chosen objective would ignore, set away from their defaults.
        ({"sapo_tau_pos": 5.0}, "sapo_tau_pos=5.0 would do nothing without use_sapo"),
        ({**ICEPOP, "use_importance_sampling_correction": False}, "use_importance_sampling"),
        ({**SEQ_MASK, "sequence_level_importance_ratios": True}, "seq-mask-tis"),
        ({"constant_length_normalizer": 8.0, "token_level_loss": True}, "token_level_loss"),
    ],
)
def test_inconsistent_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        ClippedPGLossConfig.model_validate(config)


def test_keys_at_their_defaults_and_bands_holding_1_are_accepted():
    # A recipe that lists every key at its default must still select SAPO, and a band that
    # holds 1 (NeMo's ProRL v2 uses [0.999, 1.002]) is a valid one.
    ClippedPGLossConfig.model_validate(
        {"use_sapo": True, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "sapo_tau_pos": 1.0}
    )
    ClippedPGLossConfig.model_validate({"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05})
    for band in ((0.999, 1.002), (1.0, 1.0), (0.0, 1.0)):
        ClippedPGLossConfig.model_validate(
            {
                **ICEPOP,
                "truncated_importance_sampling_ratio_min": band[0],
                "truncated_importance_sampling_ratio": band[1],
            }
        )


def test_sapo_over_a_recipes_clip_says_the_clip_does_nothing():
    with pytest.warns(UserWarning, match="use_sapo .* ratio_clip_max=0.28 does nothing"):
        config = ClippedPGLossConfig.model_validate({"use_sapo": True, "ratio_clip_max": 0.28})
    assert config.use_sapo
