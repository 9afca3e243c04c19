"""The whole-vocabulary token entropy a loss can ask for with its log-probs
(``LossTokenLogprobsAndEntropy``): values and gradients against float64 references, chunked
or not, padded or packed, however the batch is cut into micro-batches."""

import math

import pytest
import torch

from rl_data.batch import TrainBatch
from rl_models.interfaces import Logits, LossTokenLogprobsAndEntropy
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.forward import token_logprobs_and_entropy
from rl_models.policy.logprobs import chunked_logprobs, logsumexp_and_entropy

from .conftest import TINY_LLAMA, skewed_batch, tiny_config
from .test_chunked_logprobs import VOCAB_SIZE, WidestVocabTensor, inputs

ENTROPY_WEIGHT = 0.7


def float64_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Written from the definition, in float64: ``[..., 0]`` log p(target), ``[..., 1]`` H =
    -sum_v p_v log p_v."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.stack([logp.gather(-1, targets[..., None])[..., 0], entropy], -1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_chunked_entropy_values_and_gradients_equal_float64(chunk_size, temperature):
    (hidden, weight, bias), targets, upstream = inputs(torch.float64, seed=3)
    # Different upstream gradients on the two columns, so each column's backward is checked.
    up = torch.stack([upstream, torch.randn_like(upstream)], -1)
    out = chunked_logprobs(hidden, weight, targets, chunk_size, bias, temperature, entropy=True)
    assert out.shape == (*targets.shape, 2)
    (out * up).sum().backward()

    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    want = float64_logprobs_and_entropy((h @ w.T + b) / temperature, targets)
    (want * up).sum().backward()
    for got, ref, name in zip(
        (out, hidden.grad, weight.grad, bias.grad),
        (want, h.grad, w.grad, b.grad),
        ("values", "d hidden", "d weight", "d bias"),
        strict=True,
    ):
        torch.testing.assert_close(got, ref.detach(), rtol=0, atol=1e-12, msg=name)
    # The log-prob column is what the plain call gives.
    plain = chunked_logprobs(hidden, weight, targets, chunk_size, bias, temperature)
    torch.testing.assert_close(out[..., 0], plain, rtol=0, atol=0)


def test_entropy_of_a_peaked_and_a_flat_distribution():
    """Sanity of the definition beside the reference: a uniform row has log V, a one-hot-like
    row ~0, so a wrong sign or a missing term cannot hide behind a matching reference."""
    logits = torch.zeros(2, 10, dtype=torch.float64)
    logits[1, 3] = 200.0
    out = token_logprobs_and_entropy(logits, torch.tensor([0, 3]))
    want = torch.tensor([math.log(10), 0.0], dtype=torch.float64)
    torch.testing.assert_close(out[:, 1], want, rtol=0, atol=1e-12)


def test_masked_vocabulary_gives_finite_entropy_and_gradients():
    """A token masked out by a -inf logit has p = 0 and adds nothing: the entropy and the
    gradients are those of the vocabulary without it (0 * -inf must not turn into NaN)."""
    logits = torch.tensor([[0.0, 1.0, float("-inf")]], dtype=torch.float64, requires_grad=True)
    out = token_logprobs_and_entropy(logits, torch.tensor([1]))
    out.sum().backward()
    kept = logits.detach()[:, :2].clone().requires_grad_()
    want = float64_logprobs_and_entropy(kept, torch.tensor([1]))
    want.sum().backward()
    torch.testing.assert_close(out.detach(), want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(logits.grad[:, :2], kept.grad, rtol=0, atol=1e-12)
    assert logits.grad[0, 2] == 0


@pytest.mark.parametrize("chunk_size", [4, None])
def test_chunked_entropy_with_masked_vocabulary_equals_the_smaller_vocabulary(chunk_size):
    """A bias of -inf masks tokens out of the chunked path's logits (forward and the written
    backward): values and gradients are those of the vocabulary without them, and the masked
    rows of the weight and bias get a zero gradient."""
    (hidden, weight, bias), targets, upstream = inputs(torch.float64, seed=5)
    masked = torch.zeros(weight.shape[0], dtype=torch.bool)
    masked[[0, 7, 31]] = True
    targets = targets.masked_fill(masked[targets], 1)  # targets stay real tokens
    with torch.no_grad():
        bias[masked] = float("-inf")
    up = torch.stack([upstream, torch.randn_like(upstream)], -1)
    out = chunked_logprobs(hidden, weight, targets, chunk_size, bias, 0.7, entropy=True)
    (out * up).sum().backward()

    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    kept = torch.cumsum(~masked, 0) - 1  # a kept token's id in the smaller vocabulary
    want = float64_logprobs_and_entropy((h @ w[~masked].T + b[~masked]) / 0.7, kept[targets])
    (want * up).sum().backward()
    torch.testing.assert_close(out.detach(), want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden.grad, h.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.grad[~masked], w.grad[~masked], rtol=0, atol=1e-12)
    torch.testing.assert_close(bias.grad[~masked], b.grad[~masked], rtol=0, atol=1e-12)
    assert not weight.grad[masked].any() and not bias.grad[masked].any()


PRECISIONS = [torch.bfloat16, torch.float16, torch.float32]


def rounded_inputs(dtype: torch.dtype, tokens: int = 64, width: int = 32, vocab: int = 1000):
    """Hidden states, output layer and upstream gradients of a realistic spread, in ``dtype``."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(tokens, width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) / width**0.5 * 2
    bias = torch.randn(vocab, generator=gen)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    up = torch.randn(tokens, 2, generator=gen)  # float32: what the loss hands back
    return [t.to(dtype).requires_grad_() for t in (hidden, weight, bias)], targets, up


FLOAT32_BUDGET = 2.0**-18
"""Relative roundoff of the float32 softmax/entropy arithmetic, in units of a row's logit
scale: 64 float32 ulps, for exp/log and sums over ~1000 vocabulary entries (pairwise: ~10
levels of rounding). The float32 cases use 1/5 to 1/3 of their bounds; the bfloat16 and
float16 ones are dominated by their own unit roundoff, and a backward that computed log p in
bfloat16 instead of float32 overshoots their bounds 4-5x."""


def float32_roundoff(z: torch.Tensor, d_logits: torch.Tensor, up: torch.Tensor, temperature: float):
    """What float32 may get wrong in the values ``[n, 1]`` and in the gradient of the logits
    ``[n, V]``, from float64 logits ``z [n, V]`` (the rounded ones), float64's gradient of them
    and the upstream gradients ``up [n, 2]`` (log-prob, entropy). log p = z/T - lse is off by
    a few ulps of the row's scale ``m = max|z/T| + |lse| + H``, so a value by ``m * budget``
    and the gradient ``p (g_H (log p + H) + g_logp) / T`` (the target's entry adds ``-g_logp /
    T``) by ``p (|g_H| m + |g_logp|) / T * budget``, plus ``budget`` of the entry itself."""
    s = z / temperature
    lse = torch.logsumexp(s, -1, keepdim=True)
    logp = s - lse
    p = logp.exp()
    scale = s.abs().amax(-1, keepdim=True) + lse.abs() - (p * logp).sum(-1, keepdim=True)
    grad_logp, grad_ent = up[:, :1].double().abs(), up[:, 1:].double().abs()
    values = FLOAT32_BUDGET * scale
    gradient = FLOAT32_BUDGET * p * (grad_ent * scale + grad_logp) / temperature
    return values, gradient + FLOAT32_BUDGET * d_logits.abs()


def rounded_gradient_bound(dtype: torch.dtype, d_logits: torch.Tensor, float32_error):
    """The float32 gradient of the logits, rounded to ``dtype``, is off from float64's by its
    float32 error, then by the rounding (unit roundoff u of the entry), then, below ``dtype``'s
    normal range (float16: p of 1e-8), by half its subnormal spacing."""
    finfo = torch.finfo(dtype)
    u = finfo.eps / 2
    return (1 + u) * float32_error + u * d_logits.abs() + finfo.tiny * finfo.eps / 2


@pytest.mark.parametrize("dtype", PRECISIONS, ids=str)
def test_low_precision_backward_loses_only_the_roundoff_of_its_dtype(dtype):
    """The chunked path (its written backward) in bfloat16, float16 and float32 against float64
    from the SAME rounded hidden states, weights and logits (the forward's own ``dtype``
    matmul), so only the entropy/log-prob backward's own error is measured. Each gradient is
    ``G @ X`` with G the logits' gradient: its bound is G's error (``rounded_gradient_bound``)
    carried through ``|X|``, plus the product's rounding to ``dtype`` (u) on ``|G| @ |X|`` (a
    sum's roundoff scales with its terms, not with what is left after they cancel). The
    weight's and bias's gradients come back per chunk in their own dtype and autograd adds the
    4 chunks' in it (documented in logprobs.py): 3 roundings more."""
    (hidden, weight, bias), targets, up = rounded_inputs(dtype)
    temperature, chunks = 0.7, 4
    out = chunked_logprobs(hidden, weight, targets, 16, bias, temperature, entropy=True)
    (out * up).sum().backward()

    logits = torch.nn.functional.linear(hidden, weight, bias).detach()  # as the forward has it
    z = logits.double().requires_grad_()
    want = float64_logprobs_and_entropy(z / temperature, targets)
    (want * up.double()).sum().backward()
    value_error, float32_error = float32_roundoff(z.detach(), z.grad, up, temperature)
    assert ((out.detach().double() - want.detach()).abs() <= value_error).all()

    d_logits, u = z.grad, torch.finfo(dtype).eps / 2
    error_of_d_logits = rounded_gradient_bound(dtype, d_logits, float32_error)
    h, w, ones = hidden.detach().double(), weight.detach().double(), torch.ones(64, 1).double()
    for got, g, g_error, x, roundings, name in (
        (hidden.grad, d_logits, error_of_d_logits, w, 1, "d hidden"),
        (weight.grad, d_logits.T, error_of_d_logits.T, h, chunks, "d weight"),
        (bias.grad[:, None], d_logits.T, error_of_d_logits.T, ones, chunks, "d bias"),
    ):
        bound = g_error @ x.abs() + (roundings * u + FLOAT32_BUDGET) * (g.abs() @ x.abs())
        worst = float(((got.double() - g @ x).abs() / bound).max())
        assert worst <= 1, f"{name}: error {worst:.2f}x its {dtype} roundoff bound"


@pytest.mark.parametrize("dtype", PRECISIONS, ids=str)
def test_whole_logits_fallback_in_low_precision(dtype):
    """``token_logprobs_and_entropy`` on ``dtype`` logits computes in float32: its gradient of
    the logits is float64's from the same logits within ``rounded_gradient_bound``."""
    (hidden, weight, bias), targets, up = rounded_inputs(dtype)
    logits = torch.nn.functional.linear(hidden, weight, bias).detach().requires_grad_()
    out = token_logprobs_and_entropy(logits, targets, 0.7)
    (out * up).sum().backward()
    z = logits.detach().double().requires_grad_()
    want = float64_logprobs_and_entropy(z / 0.7, targets)
    (want * up.double()).sum().backward()
    value_error, float32_error = float32_roundoff(z.detach(), z.grad, up, 0.7)
    assert ((out.detach().double() - want.detach()).abs() <= value_error).all()
    bound = rounded_gradient_bound(dtype, z.grad, float32_error)
    assert float(((logits.grad.double() - z.grad).abs() / bound).max()) <= 1


def test_entropy_helper_matches_the_definition_with_masked_tokens():
    """``logsumexp_and_entropy`` (what every path uses) against the definition, with and
    without autograd (the no-graph branch reuses the softmax's buffer)."""
    z = torch.randn(3, 20, dtype=torch.float64)
    z[:, 5] = float("-inf")
    logp = torch.log_softmax(z[:, torch.arange(20) != 5], -1)
    want = -(logp.exp() * logp).sum(-1, keepdim=True)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            lse, ent = logsumexp_and_entropy(z.clone().requires_grad_(grad))
        torch.testing.assert_close(ent.detach(), want, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse.detach(), torch.logsumexp(z, -1, keepdim=True))


def test_whole_logits_fallback_equals_the_chunked_computation():
    """``token_logprobs_and_entropy`` (output layers the chunked path cannot replace) gives the
    chunked path's values and gradients."""
    (hidden, weight, bias), targets, upstream = inputs(torch.float64, seed=4)
    up = torch.stack([upstream, -2 * upstream], -1)
    out = chunked_logprobs(hidden, weight, targets, 5, bias, 0.8, entropy=True)
    (out * up).sum().backward()
    h = hidden.detach().clone().requires_grad_()
    whole = token_logprobs_and_entropy(h @ weight.detach().T + bias.detach(), targets, 0.8)
    (whole * up).sum().backward()
    torch.testing.assert_close(whole, out.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(h.grad, hidden.grad, rtol=0, atol=1e-12)


class EntropyBonusLoss:
    """-(mean log-prob) - ENTROPY_WEIGHT * (mean entropy) over the loss tokens."""

    input_type = LossTokenLogprobsAndEntropy

    def __call__(self, values, batch: TrainBatch, global_valid_seqs, global_valid_toks):
        # No assert: pytest rewrites those, and this class travels to Megatron's workers.
        if values.shape[-1] != 2:
            raise ValueError(f"expected [B, S, 2] log-probs and entropies, got {values.shape}")
        mask = batch.loss_token_mask().to(values)
        toks = global_valid_toks.clamp(min=1).to(values)
        per_token = -values[..., 0] - ENTROPY_WEIGHT * values[..., 1]
        return (per_token * mask).sum() / toks, {
            "entropy": float((values[..., 1].detach() * mask).sum())
        }


class ReferenceEntropyBonusLoss(EntropyBonusLoss):
    """The same loss from the whole ``[B, S, V]`` logits, in float64."""

    input_type = Logits

    def __call__(self, logits, batch: TrainBatch, global_valid_seqs, global_valid_toks):
        values = float64_logprobs_and_entropy(logits, batch.input_ids)
        return super().__call__(values, batch, global_valid_seqs, global_valid_toks)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_policy_trains_on_entropy_like_the_float64_logits_reference(packed):
    """A step on the chunked log-probs and entropy (4 micro-batches) moves the weights exactly
    as the same loss computed from whole logits (1 micro-batch), no logits wider than a chunk
    exist, and the metric sums to the reference's."""
    model = {"hf_config": {**TINY_LLAMA, "vocab_size": VOCAB_SIZE}, "dtype": "float64"}
    batching = {"sequence_packing": {"enabled": packed, "max_tokens_per_microbatch": 70}}
    data = skewed_batch()
    chunked = DTensorPolicyWorker(
        tiny_config(model=model, logprob_chunk_size=5, train_micro_batch_size=2, **batching)
    )
    reference = DTensorPolicyWorker(tiny_config(model=model, logprob_chunk_size=None))
    widest = WidestVocabTensor(VOCAB_SIZE)
    with widest:
        got = chunked.train(data, EntropyBonusLoss())
    assert 0 < widest.rows <= 5
    want = reference.train(data, ReferenceEntropyBonusLoss())
    assert got.metrics["entropy"][0] > 0
    torch.testing.assert_close(got.metrics["entropy"], want.metrics["entropy"], rtol=1e-12, atol=0)
    a, b = chunked.model.state_dict(), reference.model.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-10
