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
from rl_models.policy.logprobs import chunked_logprobs

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
