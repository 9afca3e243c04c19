"""DistillationLossFn against float64 references written from the formulas, token by token."""

import math

import pytest
import torch

from rl_algorithms.losses import ClippedPGLossFn, DistillationLossConfig, DistillationLossFn
from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.interfaces import GatheredLogprobs, Max, Min

B, S, V, K = 5, 8, 13, 4


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, BatchedDataDict]:
    """Student and teacher next-token logits ``[B, S, V]`` (the student's a leaf with grad) and
    a batch with padding, a prompt, a dropped sample and the teacher's top-k and sampled-token
    log-probs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([8, 5, 7, 3, 6])
    real = torch.arange(S)[None, :] < lengths[:, None]
    student = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, S), generator=g) * real
    teacher_lp = torch.log_softmax(teacher, -1)
    top_lp, top_ids = teacher_lp.topk(K, dim=-1)
    data = BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        loss_mask=((torch.arange(S)[None, :] >= 2) & real).double(),
        sample_mask=torch.tensor([1.0, 1, 0, 1, 1]),
        teacher_logprobs=teacher_lp.gather(-1, ids[..., None])[..., 0] * real,
        teacher_topk_logprobs=top_lp * real[..., None],
        teacher_topk_ids=top_ids * real[..., None],
        advantages=torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone(),
    )
    return student.requires_grad_(), teacher, data


def gathered(student_logits: torch.Tensor, data: BatchedDataDict) -> torch.Tensor:
    """What the policy passes a ``GatheredLogprobs`` loss: ``[B, S, 1 + k]``."""
    tokens = torch.cat([data["input_ids"][..., None], data["teacher_topk_ids"]], -1)
    return torch.log_softmax(student_logits, -1).gather(-1, tokens)


def sampled(student_logits: torch.Tensor, data: BatchedDataDict) -> torch.Tensor:
    return gathered(student_logits, data)[..., 0]


def loss_tokens(data: BatchedDataDict) -> list[tuple[int, int]]:
    return [
        (b, t)
        for b in range(B)
        for t in range(1, int(data["input_lengths"][b]))
        if data["loss_mask"][b, t] == 1 and data["sample_mask"][b] == 1
    ]


def call(loss_fn, values, data, tokens=None):
    toks = torch.tensor(float(len(tokens if tokens is not None else loss_tokens(data))))
    return loss_fn(values, TrainBatch.from_transport(data), torch.tensor(4.0), toks)


# -- on-policy reverse KL on the sampled tokens ----------------------------------------------


def test_sampled_token_value_and_gradient_equal_the_formula():
    student, _, data = batch()
    lp = sampled(student, data).detach().requires_grad_()
    loss, metrics = call(DistillationLossFn({"estimator": "sampled_token"}), lp, data)
    loss.backward()
    tokens = loss_tokens(data)
    d = {bt: float(lp[bt].detach() - data["teacher_logprobs"][bt]) for bt in tokens}
    want = sum(d.values()) / len(tokens)
    assert math.isclose(float(loss.detach()), want, rel_tol=0, abs_tol=1e-12)
    assert math.isclose(metrics["kl"], want, rel_tol=0, abs_tol=1e-12)
    # d loss / d log s(y_t) = (log s - log t) / N on the loss tokens, 0 elsewhere.
    want_grad = torch.zeros(B, S, dtype=torch.float64)
    for bt, v in d.items():
        want_grad[bt] = v / len(tokens)
    torch.testing.assert_close(lp.grad, want_grad, rtol=0, atol=1e-14)


def test_sampled_token_gradient_is_the_reverse_kl_gradient_in_expectation():
    """Averaged over every token y with the student's probability (exactly, no sampling), the
    surrogate's gradient is the gradient of KL(s || t) at that position."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    t_logp = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    loss_fn = DistillationLossFn({"estimator": "sampled_token"})
    expected = torch.zeros(V, dtype=torch.float64)
    for y in range(V):
        s_logp = torch.log_softmax(theta, -1)
        data = BatchedDataDict(
            input_ids=torch.tensor([[0, y]]),
            input_lengths=torch.tensor([2]),
            teacher_logprobs=torch.tensor([[0.0, float(t_logp[y])]], dtype=torch.float64),
        )
        lp = torch.stack([torch.zeros((), dtype=torch.float64), s_logp[y]])[None]
        (grad,) = torch.autograd.grad(
            loss_fn(lp, TrainBatch.from_transport(data), torch.tensor(1.0), torch.tensor(1.0))[0],
            theta,
        )
        expected += s_logp[y].exp().detach() * grad
    s_logp = torch.log_softmax(theta, -1)
    kl = (s_logp.exp() * (s_logp - t_logp)).sum()
    (analytic,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(expected, analytic, rtol=0, atol=1e-12)


# -- over the teacher's top-k ------------------------------------------------------------------


def reference_topk(student_logits, data, cfg: DistillationLossConfig) -> torch.Tensor:
    """The divergence written plainly from full-vocabulary float64 distributions: a loop over
    the loss tokens and the k ids."""
    total = torch.zeros((), dtype=torch.float64)
    tokens = loss_tokens(data)
    for b, t in tokens:
        s_full = torch.softmax(student_logits[b, t], -1)
        ids = data["teacher_topk_ids"][b, t].tolist()
        p = [math.exp(float(v)) for v in data["teacher_topk_logprobs"][b, t]]
        q = [s_full[i] for i in ids]
        if not cfg.zero_outside_topk:
            p_sum, q_sum = sum(p), sum(q)
            p, q = [x / p_sum for x in p], [x / q_sum for x in q]
        fwd = sum(p[i] * (math.log(p[i]) - torch.log(q[i])) for i in range(K))
        rev = sum(q[i] * (torch.log(q[i]) - math.log(p[i])) for i in range(K))
        if cfg.kl_type == "forward":
            div = fwd
        elif cfg.kl_type == "reverse":
            div = rev
        elif cfg.kl_type == "mixed":
            div = cfg.mixed_kl_weight * fwd + (1 - cfg.mixed_kl_weight) * rev
        else:
            beta = cfg.jsd_beta
            m = [beta * p[i] + (1 - beta) * q[i] for i in range(K)]
            div = beta * sum(p[i] * (math.log(p[i]) - torch.log(m[i])) for i in range(K))
            div = div + (1 - beta) * sum(q[i] * torch.log(q[i] / m[i]) for i in range(K))
        total = total + div
    return cfg.kl_weight * total / len(tokens)


TOPK_CONFIGS = [
    {"kl_type": "forward"},
    {"kl_type": "reverse"},
    {"kl_type": "mixed", "mixed_kl_weight": 0.3},
    {"kl_type": "jsd", "jsd_beta": 0.2},
    {"kl_type": "forward", "zero_outside_topk": True, "kl_weight": 0.7},
]


@pytest.mark.parametrize("config", TOPK_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_topk_value_and_gradient_equal_the_float64_formula(config):
    student, _, data = batch()
    cfg = DistillationLossConfig.model_validate(config)
    loss, metrics = call(DistillationLossFn(cfg), gathered(student, data), data)
    (got_grad,) = torch.autograd.grad(loss, student)
    want = reference_topk(student, data, cfg)
    (want_grad,) = torch.autograd.grad(want, student)
    assert math.isclose(float(loss), float(want), rel_tol=0, abs_tol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)
    assert math.isclose(metrics["kl"] * cfg.kl_weight, float(loss), rel_tol=1e-12)


@pytest.mark.parametrize(
    ("kl_type", "zero_outside_topk"),
    [("forward", False), ("reverse", False), ("jsd", False), ("forward", True)],
)
def test_with_k_equal_to_the_vocabulary_the_divergence_is_the_full_one(kl_type, zero_outside_topk):
    g = torch.Generator().manual_seed(2)
    s_logp = torch.log_softmax(torch.randn(1, 2, V, generator=g, dtype=torch.float64), -1)
    t_logp = torch.log_softmax(torch.randn(1, 2, V, generator=g, dtype=torch.float64), -1)
    top, ids = t_logp.topk(V, dim=-1)
    data = BatchedDataDict(
        input_ids=torch.zeros(1, 2, dtype=torch.long),
        input_lengths=torch.tensor([2]),
        teacher_topk_logprobs=top,
        teacher_topk_ids=ids,
    )
    values = torch.cat([torch.zeros(1, 2, 1, dtype=torch.float64), s_logp.gather(-1, ids)], -1)
    cfg = {"kl_type": kl_type, "zero_outside_topk": zero_outside_topk, "jsd_beta": 0.5}
    loss, _ = DistillationLossFn(cfg)(
        values, TrainBatch.from_transport(data), torch.tensor(1.0), torch.tensor(1.0)
    )
    p, q = t_logp[0, 1].exp(), s_logp[0, 1].exp()
    if kl_type == "forward":
        want = (p * (p.log() - q.log())).sum()
    elif kl_type == "reverse":
        want = (q * (q.log() - p.log())).sum()
    else:  # beta 0.5: the Jensen-Shannon divergence
        m = (p + q) / 2
        want = 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()
    assert math.isclose(float(loss), float(want), rel_tol=0, abs_tol=1e-12)


def test_zero_outside_topk_refuses_divergences_it_cannot_compute():
    with pytest.raises(ValueError, match="zero_outside_topk: true works with kl_type 'forward'"):
        DistillationLossConfig(kl_type="reverse", zero_outside_topk=True)


def test_missing_or_misshapen_teacher_fields_are_named():
    student, _, data = batch()
    del data["teacher_topk_logprobs"]
    with pytest.raises(KeyError, match="'teacher_topk_logprobs'"):
        call(DistillationLossFn(), gathered(student, data), data)
    with pytest.raises(ValueError, match=r"\[B, S, 1 \+ k\] gathered log-probs"):
        call(DistillationLossFn(), sampled(student, data), data)


# -- split invariance, masking, mixing with GRPO ---------------------------------------------


ALL_CONFIGS = [{"estimator": "sampled_token"}, *TOPK_CONFIGS]


def values_for(loss_fn, student, data):
    return (
        gathered(student, data)
        if loss_fn.input_type is GatheredLogprobs
        else sampled(student, data)
    )


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_micro_batch_splits_sum_to_the_whole_batch(config):
    student, _, data = batch()
    loss_fn = DistillationLossFn(config)
    toks = torch.tensor(float(len(loss_tokens(data))))
    whole, whole_metrics = loss_fn(
        values_for(loss_fn, student, data), TrainBatch.from_transport(data), torch.tensor(4.0), toks
    )
    (whole_grad,) = torch.autograd.grad(whole, student)
    parts, sums = [], {}
    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)):
        mb = BatchedDataDict({k: v[rows] for k, v in data.items()})
        values = values_for(loss_fn, student[rows], mb)
        loss, metrics = loss_fn(values, TrainBatch.from_transport(mb), torch.tensor(4.0), toks)
        parts.append(loss)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    (split_grad,) = torch.autograd.grad(sum(parts), student)
    assert math.isclose(float(sum(parts)), float(whole), rel_tol=0, abs_tol=1e-12)
    torch.testing.assert_close(split_grad, whole_grad, rtol=0, atol=1e-14)
    for k, v in whole_metrics.items():
        assert math.isclose(sums[k], v, rel_tol=1e-10, abs_tol=1e-12), k


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_prompt_padding_and_dropped_samples_add_nothing_even_when_extreme(config):
    student, _, data = batch()
    loss_fn = DistillationLossFn(config)
    clean, clean_metrics = call(loss_fn, values_for(loss_fn, student, data), data)
    (clean_grad,) = torch.autograd.grad(clean, student)

    off = TrainBatch.from_transport(data).loss_token_mask() == 0
    extreme = BatchedDataDict(dict(data))
    for key, value in (("teacher_logprobs", 1e30), ("teacher_topk_logprobs", -math.inf)):
        extreme[key] = data[key].clone()
        extreme[key][off] = value
    values = values_for(loss_fn, student, data)
    poison = (
        torch.full_like(values, math.inf) if values.dim() == 2 else torch.full_like(values, -1e30)
    )
    mask = off if values.dim() == 2 else off[..., None].expand_as(values)
    values = torch.where(mask, poison, values)
    loss, metrics = call(loss_fn, values, extreme)
    (grad,) = torch.autograd.grad(loss, student)
    assert math.isclose(float(loss), float(clean), rel_tol=0, abs_tol=1e-12)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=1e-14)
    assert metrics == pytest.approx(clean_metrics, abs=1e-12)
    assert set(metrics) == loss_fn.METRICS


@pytest.mark.parametrize("estimator", ["sampled_token", "topk"])
def test_mixing_with_grpo_adds_the_clipped_pg_loss_unchanged(estimator):
    student, _, data = batch()
    pg = ClippedPGLossFn(pi_old_is_current=True)
    cfg = {"estimator": estimator, "kl_weight": 0.25}
    mixed_fn, alone_fn = DistillationLossFn(cfg, pg_loss=pg), DistillationLossFn(cfg)
    assert mixed_fn.input_type == alone_fn.input_type
    values = values_for(mixed_fn, student, data)
    mixed, metrics = call(mixed_fn, values, data)
    alone, _ = call(alone_fn, values, data)
    pg_loss, pg_metrics = call(pg, sampled(student, data), data)
    (got,) = torch.autograd.grad(mixed, student, retain_graph=True)
    (want,) = torch.autograd.grad(alone + pg_loss, student)
    assert math.isclose(float(mixed), float(alone + pg_loss), rel_tol=0, abs_tol=1e-12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    assert metrics["pg_clip_fraction"] == pg_metrics["clip_fraction"]
    assert set(metrics) == mixed_fn.METRICS
    assert {
        "advantages",
        "teacher_logprobs" if estimator == "sampled_token" else "teacher_topk_ids",
    } <= mixed_fn.batch_fields()


def test_the_mixed_pg_extremes_keep_their_declared_reduction():
    student, _, data = batch()
    pg = ClippedPGLossFn(pi_old_is_current=True)
    loss_fn = DistillationLossFn({"estimator": "sampled_token"}, pg_loss=pg)
    _, metrics = call(loss_fn, values_for(loss_fn, student, data), data)
    assert isinstance(metrics["pg_probs_ratio_min"], Min)
    assert isinstance(metrics["pg_probs_ratio_max"], Max)
