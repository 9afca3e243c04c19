"""Full-vocabulary logits, the mask-free packed path, and losses that take logits."""

import pytest
import torch

from rl_data.batch import TrainBatch
from rl_models.interfaces import Logits, Logprobs, LossTokenLogprobs, loss_input_type
from rl_models.losses import LabelSmoothedNLLLoss, NLLLoss
from rl_models.policy import forward, logprobs
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import TINY_LLAMA, initial_model, skewed_batch, tiny_config


def reference_model(seed: int = 0) -> torch.nn.Module:
    return initial_model(seed)


def reference_logits(model, data) -> torch.Tensor:
    """Each sequence alone, unpadded; shifted so that ``[:, t]`` predicts token ``t``."""
    ids_all, lengths = data["input_ids"], data["input_lengths"]
    out = torch.zeros(*ids_all.shape, TINY_LLAMA["vocab_size"], dtype=torch.float64)
    for row, (ids, n) in enumerate(zip(ids_all, lengths, strict=True)):
        out[row, 1:n] = model(ids[None, :n]).logits[0, : n - 1]
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_logits_are_aligned_to_the_tokens_they_predict(packed):
    data = skewed_batch()
    config = tiny_config(sequence_packing={"enabled": packed, "max_tokens_per_microbatch": 70})
    worker = DTensorPolicyWorker(config)
    with torch.no_grad():
        got = forward.forward_logits(worker.model, data, forward.ForwardOptions(packed=packed))
        expected = reference_logits(reference_model(), data)
        logprobs = worker.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    # The log-probs a worker reports are these logits' log-softmax at the input tokens.
    from_logits = forward.token_logprobs(got, data["input_ids"]) * TrainBatch.from_transport(
        data
    ).loss_token_mask().ne(0)
    mask = TrainBatch.from_transport(data).loss_token_mask().ne(0)
    torch.testing.assert_close(from_logits[mask], logprobs[mask], rtol=0, atol=1e-10)


def test_packed_rows_without_a_mask_are_split_by_their_position_ids(monkeypatch):
    """What flash-attention kernels get: no mask; Hugging Face finds the sequences from the
    restarting position ids. Checked here with sdpa, which takes the same detection path."""
    data = skewed_batch()
    worker = DTensorPolicyWorker(tiny_config())
    monkeypatch.setattr(forward, "DENSE_MASK_KERNELS", ())
    _, inputs = forward._packed_inputs(data, "sdpa")
    assert inputs["attention_mask"] is None
    with torch.no_grad():
        got = forward.forward_logprobs(worker.model, data, forward.ForwardOptions(packed=True))
        unpacked = forward.forward_logprobs(worker.model, data, forward.ForwardOptions())
    torch.testing.assert_close(got, unpacked, rtol=0, atol=1e-10)


def test_packed_rows_under_eager_attention_are_kept_apart():
    """Eager attention adds its 4-D mask to the scores: a boolean one would mask nothing."""
    data = skewed_batch()
    model = reference_model()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for_packed = forward.ForwardOptions(packed=True, attn_implementation="eager")
        packed = forward.forward_logprobs(model, data, for_packed)
        padded = forward.forward_logprobs(
            model, data, forward.ForwardOptions(attn_implementation="eager")
        )
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-6)  # eager softmax: float32


def label_smoothed_reference_step(data, smoothing: float) -> dict[str, torch.Tensor]:
    """One SGD step (lr=1) on the float64 reference model, the loss written out by hand."""
    model = reference_model()
    mask = TrainBatch.from_transport(data).loss_token_mask()
    total = torch.zeros((), dtype=torch.float64)
    for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
        logits = model(ids[None, :n]).logits[0, : n - 1]
        logp = logits - logits.logsumexp(-1, keepdim=True)
        nll = -logp.gather(-1, ids[1:n, None])[:, 0]
        uniform = -logp.sum(-1) / logp.shape[-1]
        total = total + (((1 - smoothing) * nll + smoothing * uniform) * mask[row, 1:n]).sum()
    (total / mask.sum()).backward()
    with torch.no_grad():
        return {k: p - p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize(
    "split",
    [{"train_micro_batch_size": 3}, {"sequence_packing": {"enabled": True}}],
    ids=["microbatches", "packed"],
)
def test_a_logits_loss_trains_like_the_hand_written_reference(split):
    data = skewed_batch()
    loss = LabelSmoothedNLLLoss(smoothing=0.2)
    assert loss_input_type(loss) is Logits
    assert loss_input_type(NLLLoss()) is LossTokenLogprobs
    worker = DTensorPolicyWorker(tiny_config(**split))
    worker.train(data, loss)
    expected = label_smoothed_reference_step(data, smoothing=0.2)
    got = {k: p.detach() for k, p in worker.model.named_parameters()}
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) < 1e-10


class FullNLLLoss(NLLLoss):
    input_type = Logprobs  # every position's log-prob computed


def nll_reference_gradients(data, weights=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(weight, gradient) of the loss-token NLL on the float64 reference model (at ``weights``,
    a state dict, if given), by name."""
    model = reference_model()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    mask = TrainBatch.from_transport(data).loss_token_mask()
    total = torch.zeros((), dtype=torch.float64)
    for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
        logp = torch.log_softmax(model(ids[None, :n]).logits[0, : n - 1], -1)
        total = total - (logp.gather(-1, ids[1:n, None])[:, 0] * mask[row, 1:n]).sum()
    (total / mask.sum()).backward()
    return {k: (p.detach(), p.grad) for k, p in model.named_parameters()}


def nll_reference_step(data) -> dict[str, torch.Tensor]:
    """One SGD step (lr=1) of the loss-token NLL on the float64 reference model."""
    return {k: w - g for k, (w, g) in nll_reference_gradients(data).items()}


@pytest.mark.parametrize("fused", [False, True], ids=["for-loop", "fused"])
def test_clipped_adamw_steps_match_the_formula(fused):
    """AdamW, torch's fused kernel (what the main recipe asks for) or its for-loop, after
    clipping: two steps on two batches written out from the formula, on float64 reference
    gradients (two, so that the moments' decay rates count)."""
    lr, beta1, beta2, eps, decay, max_norm = 1e-2, 0.8, 0.9, 1e-8, 0.1, 0.05
    kwargs = {"lr": lr, "betas": (beta1, beta2), "eps": eps, "weight_decay": decay, "fused": fused}
    worker = DTensorPolicyWorker(
        tiny_config(optimizer={"name": "AdamW", "kwargs": kwargs}, max_grad_norm=max_norm)
    )
    assert all(group["fused"] is fused for group in worker.optimizer.param_groups)
    weights, moments = None, {}
    for step, seed in enumerate((1, 2), start=1):
        data = skewed_batch(seed=seed)
        worker.train(data, NLLLoss())
        reference = nll_reference_gradients(data, weights)
        norm = torch.sqrt(sum((g**2).sum() for _, g in reference.values()))
        assert norm > max_norm  # the clip acts
        weights = {}
        for name, (weight, grad) in reference.items():
            grad = grad * (max_norm / (norm + 1e-6))  # clip_grad_norm_'s scale
            m, v = moments.get(name, (torch.zeros_like(grad), torch.zeros_like(grad)))
            m, v = beta1 * m + (1 - beta1) * grad, beta2 * v + (1 - beta2) * grad**2
            moments[name] = m, v
            m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
            weights[name] = weight * (1 - lr * decay) - lr * m_hat / (v_hat.sqrt() + eps)
        got = dict(worker.model.named_parameters())
        for name, expected in weights.items():
            torch.testing.assert_close(got[name].detach(), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "split",
    [
        {"train_micro_batch_size": 3},
        {"train_micro_batch_size": 3, "logprob_chunk_size": None},
        {"sequence_packing": {"enabled": True}, "logprob_chunk_size": 7},
    ],
    ids=["microbatches", "unchunked", "packed-chunked"],
)
def test_loss_token_logprobs_skip_the_prompt_and_train_exactly_like_full_logprobs(
    split, monkeypatch
):
    """A loss with ``input_type = LossTokenLogprobs`` gets log-probs at its tokens only: the
    output layer sees just those hidden states, and the step equals the float64 reference."""
    data = skewed_batch()
    seen = []
    chunk = logprobs._chunk_logprobs

    def counted(hidden, *args):
        seen.append(hidden.shape[0])  # the output layer's rows
        return chunk(hidden, *args)

    monkeypatch.setattr(logprobs, "_chunk_logprobs", counted)
    worker = DTensorPolicyWorker(tiny_config(**split))
    worker.train(data, NLLLoss())
    loss_tokens = int(TrainBatch.from_transport(data).loss_token_mask().ne(0).sum())
    assert loss_tokens < int(data["input_lengths"].sum()) // 2 + 8
    # Once each (twice where chunks are recomputed in backward), never a prompt token.
    assert sum(seen) in (loss_tokens, 2 * loss_tokens)
    expected = nll_reference_step(data)
    got = {k: p.detach() for k, p in worker.model.named_parameters()}
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) < 1e-10
    # And the same step as a loss given every position's log-prob.
    full = DTensorPolicyWorker(tiny_config(**split))
    full.train(data, FullNLLLoss())
    for k, p in full.model.named_parameters():
        torch.testing.assert_close(p.detach(), got[k], rtol=0, atol=1e-12)


def test_label_smoothing_zero_is_plain_nll():
    data = skewed_batch()
    a = DTensorPolicyWorker(tiny_config(train_micro_batch_size=3))
    b = DTensorPolicyWorker(tiny_config(train_micro_batch_size=3))
    la = a.train(data, LabelSmoothedNLLLoss(smoothing=0.0)).metrics["loss"]
    lb = b.train(data, NLLLoss()).metrics["loss"]
    assert la == pytest.approx(lb, abs=1e-12)


def test_a_loss_asking_for_an_unknown_input_is_refused():
    class Odd(NLLLoss):
        input_type = "hidden_states"

    with pytest.raises(ValueError, match=r"Odd\.input_type is 'hidden_states'"):
        DTensorPolicyWorker(tiny_config()).train(skewed_batch(), Odd())
