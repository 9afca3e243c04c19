"""ClippedValueLossFn against a float64 reference written token by token (PPO2's clipped value
loss), micro-batch split invariance, and the zero gradient where the clip is in force."""

import math

import pytest
import torch
from pydantic import ValidationError

from rl_algorithms.losses import ClippedValueLossFn, ValueLossConfig
from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.interfaces import Max, Min, Values

CLIP = 0.2


def value_batch(seed: int = 0) -> tuple[torch.Tensor, BatchedDataDict]:
    """Current values (a leaf with grad) and a batch with tokens on both sides of the clip,
    prompts, padding, an observation gap and a dropped sample. NaN off the loss tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 10, 5, 10, 8, 4])
    B, S = len(lengths), 10
    real = torch.arange(S)[None, :] < lengths[:, None]
    token_mask = (torch.arange(S)[None, :] >= 2) & real
    token_mask[1, 5:7] = False  # an observation between two turns
    sample_mask = torch.tensor([1.0, 1, 1, 0, 1, 1])
    old = torch.randn(B, S, generator=g, dtype=torch.float64)
    returns = old + torch.randn(B, S, generator=g, dtype=torch.float64)
    # New values within and beyond the clip range of the old ones.
    values = old + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.4
    off = ~(token_mask & real)
    values = values.masked_fill(off, torch.nan)
    data = BatchedDataDict(
        input_ids=torch.randint(1, 50, (B, S), generator=g) * real,
        input_lengths=lengths,
        loss_mask=token_mask.double(),
        sample_mask=sample_mask,
        values=old.masked_fill(off, torch.inf),
        returns=returns.masked_fill(off, -torch.inf),
    )
    return values.requires_grad_(True), data


def reference_loss(values, data, clip):
    """sum over loss tokens of 0.5 * max((V - R)^2, (V_old + clip(V - V_old) - R)^2) / N."""
    terms, active = [], 0
    for b in range(values.shape[0]):
        if data["sample_mask"][b] == 0:
            continue
        for t in range(1, int(data["input_lengths"][b])):
            if data["loss_mask"][b, t] == 0:
                continue
            v, v_old, r = values[b, t], float(data["values"][b, t]), float(data["returns"][b, t])
            plain = (v - r) ** 2
            if clip is None:
                terms.append(0.5 * plain)
                continue
            v_clip = v_old + min(max(float(v.detach()) - v_old, -clip), clip)
            if abs(float(v.detach()) - v_old) > clip:  # the clipped prediction is a constant
                clipped = (torch.tensor(v_clip, dtype=torch.float64) - r) ** 2
            else:
                clipped = (v - r) ** 2
            if float(clipped.detach()) > float(plain.detach()):
                active += 1
            terms.append(0.5 * torch.maximum(plain, clipped))
    return sum(terms) / len(terms), active / len(terms), len(terms)


def counts(data):
    return TrainBatch.from_transport(data).sample_valid_mask().sum(), TrainBatch.from_transport(
        data
    ).loss_token_mask().sum()


@pytest.mark.parametrize("clip,scale", [(CLIP, 1.0), (None, 1.0), (CLIP, 0.4)])
def test_value_loss_and_gradient_match_the_reference(clip, scale):
    values, data = value_batch()
    # scale (NeMo RL's value_loss_fn.scale) multiplies the loss and so the gradient.
    loss, metrics = ClippedValueLossFn({"value_clip": clip, "scale": scale})(
        values, TrainBatch.from_transport(data), *counts(data)
    )
    (grad,) = torch.autograd.grad(loss, values)

    ref_values = values.detach().clone().requires_grad_(True)
    want, clip_fraction, n = reference_loss(ref_values, data, clip)
    want = scale * want
    (want_grad,) = torch.autograd.grad(want, ref_values)

    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    assert math.isclose(metrics["value_loss"], float(want.detach()), rel_tol=1e-12)
    assert math.isclose(metrics["value_clip_fraction"], clip_fraction, abs_tol=1e-12)
    if clip is not None:
        assert 0 < clip_fraction < 1  # the batch exercises both branches
    assert metrics.keys() == ClippedValueLossFn.METRICS
    mask = TrainBatch.from_transport(data).loss_token_mask() > 0
    v = values.detach()[mask]
    assert math.isclose(metrics["value_mean"], float(v.sum()) / n, rel_tol=1e-12)
    assert metrics["value_min"] == float(v.min()) and metrics["value_max"] == float(v.max())
    assert math.isclose(metrics["returns_mean"], float(data["returns"][mask].sum()) / n)


def test_clipped_tokens_get_no_gradient():
    """V_old = 0, R = 1: a prediction moved past V_old + clip towards R (0.9) is held by the
    clipped term (no gradient); one within the clip range (0.1), or moved away from R (-0.5),
    is trained by the plain squared error."""
    data = BatchedDataDict(
        input_ids=torch.ones(1, 4, dtype=torch.long),
        input_lengths=torch.tensor([4]),
        values=torch.zeros(1, 4, dtype=torch.float64),
        returns=torch.ones(1, 4, dtype=torch.float64),
    )
    values = torch.tensor([[0.0, 0.9, 0.1, -0.5]], dtype=torch.float64, requires_grad=True)
    loss, metrics = ClippedValueLossFn({"value_clip": CLIP})(
        values, TrainBatch.from_transport(data), *counts(data)
    )
    (grad,) = torch.autograd.grad(loss, values)
    n = 3  # position 0 is never a loss token
    want = torch.tensor([[0.0, 0.0, (0.1 - 1) / n, (-0.5 - 1) / n]], dtype=torch.float64)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)
    assert math.isclose(metrics["value_clip_fraction"], 1 / 3)
    clipped_term = 0.5 * (0.2 - 1) ** 2
    want_loss = (clipped_term + 0.5 * 0.9**2 + 0.5 * 1.5**2) / n
    assert math.isclose(float(loss.detach()), want_loss, rel_tol=1e-12)


def test_micro_batches_add_up_to_the_global_batch():
    values, data = value_batch(seed=1)
    fn = ClippedValueLossFn()
    seqs, toks = counts(data)
    whole, whole_metrics = fn(values, TrainBatch.from_transport(data), seqs, toks)
    (whole_grad,) = torch.autograd.grad(whole, values)

    parts, grads, metric_sums = [], [], {}
    for rows in (slice(0, 2), slice(2, 6)):
        part_values = values.detach()[rows].clone().requires_grad_(True)
        part = BatchedDataDict({k: v[rows] for k, v in data.items()})
        loss, metrics = fn(part_values, TrainBatch.from_transport(part), seqs, toks)
        (g,) = torch.autograd.grad(loss, part_values)
        parts.append(loss)
        grads.append(g)
        for k, m in metrics.items():
            if k.endswith("_min"):
                metric_sums[k] = min(metric_sums.get(k, math.inf), m)
            elif k.endswith("_max"):
                metric_sums[k] = max(metric_sums.get(k, -math.inf), m)
            else:
                metric_sums[k] = metric_sums.get(k, 0.0) + m
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(grads), whole_grad, rtol=1e-12, atol=1e-12)
    for k, m in whole_metrics.items():
        assert math.isclose(metric_sums[k], m, rel_tol=1e-12, abs_tol=1e-12), k


def test_config_and_missing_keys():
    assert ValueLossConfig().value_clip == 0.2
    assert ValueLossConfig(value_clip=None).value_clip is None
    with pytest.raises(ValidationError):
        ValueLossConfig(value_clip=0.0)
    with pytest.raises(ValidationError):
        ValueLossConfig(cliprange_value=0.2)
    fn = ClippedValueLossFn()
    assert fn.input_type is Values
    assert {"values", "returns"} <= fn.batch_fields()
    values, data = value_batch()
    del data["returns"]
    with pytest.raises(KeyError, match="'returns'"):
        fn(values, TrainBatch.from_transport(data), *counts(data))


def test_value_extremes_are_declared_min_and_max():
    values, data = value_batch()
    _, metrics = ClippedValueLossFn({})(values, TrainBatch.from_transport(data), *counts(data))
    assert isinstance(metrics["value_min"], Min) and isinstance(metrics["value_max"], Max)
    assert type(metrics["value_mean"]) is float
