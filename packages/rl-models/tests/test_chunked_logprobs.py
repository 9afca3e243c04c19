"""Log-probs computed a chunk of tokens at a time: exact values and gradients, bounded logits."""

import pytest
import torch

from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.logprobs import chunked_logprobs

from .conftest import TINY_LLAMA, WidestVocabTensor, skewed_batch, tiny_config

TOKENS, HIDDEN, VOCAB = (2, 25), 16, 50
VOCAB_SIZE = 157


def inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    bias = torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, TOKENS, generator=gen)
    upstream = torch.randn(*TOKENS, generator=gen, dtype=torch.float64)
    cast = [t.to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    return cast, targets, upstream


def float64_reference(hidden, weight, bias, targets, upstream):
    """Unchunked, float64: log_softmax of the whole logits, then the targets' entries."""
    h, w, b = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    lp = torch.log_softmax(h @ w.T + b, dim=-1).gather(-1, targets[..., None])[..., 0]
    (lp * upstream).sum().backward()
    return lp.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize("chunk_size", [1, 7, 50, None])
def test_values_and_gradients_equal_the_unchunked_float64_computation(chunk_size):
    (hidden, weight, bias), targets, upstream = inputs(torch.float64)
    lp = chunked_logprobs(hidden, weight, targets, chunk_size, bias=bias)
    (lp * upstream).sum().backward()
    want = float64_reference(hidden, weight, bias, targets, upstream)
    got = (lp.detach(), hidden.grad, weight.grad, bias.grad)
    for g, w, name in zip(got, want, ("logprobs", "d hidden", "d weight", "d bias"), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=name)


def test_bfloat16_inputs_get_a_float32_log_softmax():
    (hidden, weight, bias), targets, upstream = inputs(torch.bfloat16)
    lp = chunked_logprobs(hidden, weight, targets, 7, bias=bias)
    assert lp.dtype == torch.float32
    (lp * upstream.float()).sum().backward()
    want_lp = float64_reference(hidden, weight, bias, targets, upstream)[0]
    # bf16 matmuls (8 bits of mantissa) against float64: loose, but no chunk-dependent error.
    torch.testing.assert_close(lp.double(), want_lp, rtol=0.02, atol=0.15)
    unchunked = chunked_logprobs(hidden, weight, targets, None, bias=bias)
    torch.testing.assert_close(lp, unchunked, rtol=0, atol=0)


@pytest.mark.parametrize("k", [None, 3], ids=["one-target", "three-targets"])
def test_temperature_and_several_targets_equal_the_float64_computation(k):
    (hidden, weight, bias), targets, upstream = inputs(torch.float64, seed=1)
    gen = torch.Generator().manual_seed(2)
    if k is not None:
        targets = torch.randint(0, VOCAB, (*TOKENS, k), generator=gen)
        targets[..., 1] = targets[..., 0]  # a token asked about twice gets both gradients
        upstream = torch.randn(*TOKENS, k, generator=gen, dtype=torch.float64)
    lp = chunked_logprobs(hidden, weight, targets, 7, bias=bias, temperature=0.6)
    (lp * upstream).sum().backward()
    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    logp = torch.log_softmax((h @ w.T + b) / 0.6, dim=-1)
    want = logp.gather(-1, targets if k else targets[..., None])
    want = want if k else want[..., 0]
    (want * upstream).sum().backward()
    got = (lp, hidden.grad, weight.grad, bias.grad)
    for g, ref, name in zip(
        got, (want, h.grad, w.grad, b.grad), ("lp", "dh", "dw", "db"), strict=True
    ):
        torch.testing.assert_close(g, ref.detach(), rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunked"])
def test_under_bf16_autocast_the_gradients_are_autograds_own(chunk):
    """The hand-written backward rounds as autograd does under autocast: bf16 logits, a
    float32 log-softmax, the logits' gradient rounded to bf16 for the two matmuls."""
    (hidden, weight, bias), targets, upstream = inputs(torch.float32, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = chunked_logprobs(hidden, weight, targets, chunk, bias=bias)
    (lp * upstream.float()).sum().backward()
    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(h, w, b).float()
        want = (logits.gather(-1, targets[..., None]) - logits.logsumexp(-1, True))[..., 0]
    (want * upstream.float()).sum().backward()
    assert lp.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    torch.testing.assert_close(lp, want, rtol=0, atol=0)
    for g, ref in ((hidden.grad, h.grad), (weight.grad, w.grad), (bias.grad, b.grad)):
        if chunk is None:  # the same roundings, bit for bit
            torch.testing.assert_close(g, ref, rtol=0, atol=0)
        else:  # the weight's gradient summed over chunks of bf16 products, in float32
            torch.testing.assert_close(g, ref, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_no_logits_wider_than_a_chunk_exist_and_training_is_unchanged(packed):
    # A vocabulary no other dimension of the model shares, so only logits match its size.
    model = {"hf_config": {**TINY_LLAMA, "vocab_size": VOCAB_SIZE}, "dtype": "float64"}
    batching = {"sequence_packing": {"enabled": packed, "max_tokens_per_microbatch": 70}}
    data = skewed_batch()
    chunked = DTensorPolicyWorker(tiny_config(model=model, logprob_chunk_size=5, **batching))
    whole = DTensorPolicyWorker(tiny_config(model=model, logprob_chunk_size=None, **batching))
    widest = WidestVocabTensor(VOCAB_SIZE)
    with widest:
        got = chunked.get_logprobs(data)["logprobs"]
        chunked.train(data, NLLLoss())
    assert 0 < widest.rows <= 5  # forward, recomputation and backward alike
    torch.testing.assert_close(got, whole.get_logprobs(data)["logprobs"], rtol=0, atol=1e-12)

    whole.train(data, NLLLoss())
    a, b = chunked.model.state_dict(), whole.model.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-10
