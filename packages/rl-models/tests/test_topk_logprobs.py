"""Distillation numerics in the output layer: a teacher's top-k log-probs and a student's
log-probs at given ids, chunked, against the whole float64 log-softmax."""

import pytest
import torch

from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.interfaces import GatheredLogprobs, loss_input_type
from rl_models.modeling.build import build_model
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.forward import ForwardOptions, forward_logprobs, forward_topk_logprobs
from rl_models.policy.logprobs import chunked_logprobs, chunked_topk_logprobs

from .conftest import TINY_LLAMA, initial_model, skewed_batch, tiny_config
from .test_chunked_logprobs import VOCAB_SIZE, WidestVocabTensor

TOKENS, HIDDEN, VOCAB, K = (3, 11), 16, 50, 5


def layer(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    bias = torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    return hidden, weight, bias


def full_log_softmax(hidden, weight, bias, temperature=1.0):
    return torch.log_softmax((hidden @ weight.T + bias) / temperature, dim=-1)


@pytest.mark.parametrize("chunk_size", [1, 4, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_topk_equals_topk_of_the_whole_log_softmax(chunk_size, temperature):
    hidden, weight, bias = layer()
    values, ids = chunked_topk_logprobs(hidden, weight, K, chunk_size, bias, temperature)
    want_values, want_ids = full_log_softmax(hidden, weight, bias, temperature).topk(K, dim=-1)
    assert ids.dtype == torch.long and ids.shape == (*TOKENS, K)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-12)


def test_topk_refuses_a_k_larger_than_the_vocabulary():
    hidden, weight, bias = layer()
    with pytest.raises(ValueError, match="k <= vocabulary size 50"):
        chunked_topk_logprobs(hidden, weight, VOCAB + 1, 4, bias)


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_logprobs_at_k_ids_and_their_gradients_equal_the_whole_computation(chunk_size):
    hidden, weight, bias = (t.clone().requires_grad_() for t in layer())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (*TOKENS, K), generator=gen)
    upstream = torch.randn(*TOKENS, K, generator=gen, dtype=torch.float64)
    got = chunked_logprobs(hidden, weight, ids, chunk_size, bias, temperature=0.8)
    (got * upstream).sum().backward()
    got_grads = [t.grad for t in (hidden, weight, bias)]

    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    want = full_log_softmax(h, w, b, 0.8).gather(-1, ids)
    (want * upstream).sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w_, name in zip(got_grads, (h.grad, w.grad, b.grad), "hwb", strict=True):
        torch.testing.assert_close(g, w_, rtol=0, atol=1e-12, msg=name)


def whole_model_log_softmax(data, temperature=1.0) -> torch.Tensor:
    """Each sequence alone through the plain float64 model; ``[:, t]`` predicts token ``t``."""
    model = initial_model()
    ids_all, lengths = data["input_ids"], data["input_lengths"]
    out = torch.zeros(*ids_all.shape, TINY_LLAMA["vocab_size"], dtype=torch.float64)
    with torch.no_grad():
        for row, (ids, n) in enumerate(zip(ids_all, lengths, strict=True)):
            logits = model(ids[None, :n]).logits[0, : n - 1] / temperature
            out[row, 1:n] = torch.log_softmax(logits, dim=-1)
    return out


def real_positions(data) -> torch.Tensor:
    pos = torch.arange(data["input_ids"].shape[1])
    return (pos[None] < data["input_lengths"][:, None]) & (pos[None] > 0)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_worker_topk_is_aligned_and_equals_the_whole_log_softmax(packed):
    data = skewed_batch()
    config = tiny_config(
        logprob_chunk_size=6,
        logprob_temperature=0.9,
        sequence_packing={"enabled": packed, "max_tokens_per_microbatch": 70},
    )
    out = DTensorPolicyWorker(config).get_topk_logprobs(data, k=K)
    want_values, want_ids = whole_model_log_softmax(data, 0.9).topk(K, dim=-1)
    real = real_positions(data)
    assert out["topk_ids"].shape == (*data["input_ids"].shape, K)
    assert torch.equal(out["topk_ids"][real], want_ids[real])
    torch.testing.assert_close(out["topk_logprobs"][real], want_values[real], rtol=0, atol=1e-10)
    # Position 0 and padding: nothing predicts them.
    assert not out["topk_logprobs"][~real].any() and not out["topk_ids"][~real].any()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("chunk_size", [5, None])
def test_gathered_logprobs_are_the_input_token_then_the_given_ids(packed, chunk_size):
    data = skewed_batch()
    gen = torch.Generator().manual_seed(3)
    gather = torch.randint(
        0, TINY_LLAMA["vocab_size"], (*data["input_ids"].shape, K), generator=gen
    )
    model = initial_model()
    with torch.no_grad():
        options = ForwardOptions(packed=packed, chunk_size=chunk_size)
        got = forward_logprobs(model, data, options, gather_ids=gather)
        plain = forward_logprobs(model, data, options)
    full = whole_model_log_softmax(data)
    real = real_positions(data)
    assert got.shape == (*data["input_ids"].shape, 1 + K)
    want_rest = full.gather(-1, gather)
    want_first = full.gather(-1, data["input_ids"][..., None])[..., 0]
    torch.testing.assert_close(got[..., 1:][real], want_rest[real], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[..., 0][real], want_first[real], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[..., 0], plain, rtol=0, atol=1e-12)
    assert not got[~real].any()


def test_forward_topk_without_the_worker_matches_padded_and_packed():
    data = skewed_batch()
    model = initial_model()
    with torch.no_grad():
        padded = forward_topk_logprobs(model, data, ForwardOptions(chunk_size=4), k=3)
        packed = forward_topk_logprobs(model, data, ForwardOptions(packed=True), k=3)
    assert torch.equal(padded[1], packed[1])
    torch.testing.assert_close(padded[0], packed[0], rtol=0, atol=1e-10)


class GatheredSum:
    """A loss over gathered log-probs: a fixed linear function of every entry it reads."""

    input_type = GatheredLogprobs

    def __init__(self, weights: torch.Tensor):
        self.weights = weights

    def __call__(self, lp, data, global_valid_seqs, global_valid_toks):
        mask = data.loss_token_mask().to(lp)[..., None]
        w = self.weights[data.idx, : lp.shape[1]].to(lp)
        return (lp * w * mask).sum() / global_valid_toks.to(lp), {}


def test_training_on_gathered_logprobs_never_makes_whole_logits_and_matches_float64():
    """The student's side: one SGD step on a loss of the gathered log-probs is the step of the
    same loss written on the whole log-softmax (plain model, float64), and no tensor with a
    vocabulary-sized last dimension wider than a chunk exists."""
    model = {"hf_config": {**TINY_LLAMA, "vocab_size": VOCAB_SIZE}, "dtype": "float64"}
    data = skewed_batch()
    data["idx"] = torch.arange(data.size)
    gen = torch.Generator().manual_seed(4)
    data["teacher_topk_ids"] = torch.randint(
        0, VOCAB_SIZE, (*data["input_ids"].shape, K), generator=gen
    )
    weights = torch.randn(*data["input_ids"].shape, 1 + K, generator=gen, dtype=torch.float64)
    loss = GatheredSum(weights)
    assert loss_input_type(loss) is GatheredLogprobs
    config = tiny_config(model=model, logprob_chunk_size=5, train_micro_batch_size=3)
    worker = DTensorPolicyWorker(config)
    widest = WidestVocabTensor(VOCAB_SIZE)
    with widest:
        worker.train(data, loss)
    assert 0 < widest.rows <= 5

    # Reference: the whole float64 log-softmax, one SGD step with lr 1.
    ref = build_model(config.model, config.seed)
    ids, lengths = data["input_ids"], data["input_lengths"]
    mask = TrainBatch.from_transport(data).loss_token_mask()
    total = torch.zeros((), dtype=torch.float64)
    for row in range(data.size):
        n = int(lengths[row])
        logp = torch.log_softmax(ref(ids[row : row + 1, :n]).logits[0, : n - 1], dim=-1)
        tokens = torch.cat([ids[row, 1:n, None], data["teacher_topk_ids"][row, 1:n]], dim=-1)
        picked = logp.gather(-1, tokens)
        total = total + (picked * weights[row, 1:n] * mask[row, 1:n, None]).sum()
    (total / mask.sum()).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    got, want = worker.model.state_dict(), ref.state_dict()
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-10


def test_a_gathered_loss_without_teacher_ids_is_refused_by_name():
    data = skewed_batch()
    data["idx"] = torch.arange(data.size)
    loss = GatheredSum(torch.zeros(*data["input_ids"].shape, 1 + K, dtype=torch.float64))
    with pytest.raises(KeyError, match="needs 'teacher_topk_ids'"):
        DTensorPolicyWorker(tiny_config()).train(BatchedDataDict(dict(data)), loss)
