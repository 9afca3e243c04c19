"""Rows that share a prompt run it once: the same log-probs and training step as a plain
forward, checked against a float64 reference that runs every row alone."""

import pytest
import torch

from rl_models.losses import NLLLoss, loss_token_mask
from rl_models.policy import forward
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.shared_prefix import prefix_lengths, shared_prefixes

from .conftest import grouped_batch, initial_model, tiny_config


def reference_step(data, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """One SGD step (lr=1) of the loss-token NLL, every row run alone in float64."""
    model = initial_model()
    mask = loss_token_mask(data)
    total = torch.zeros((), dtype=torch.float64)
    for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
        logits = model(ids[None, :n]).logits[0, : n - 1] / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, ids[1:n, None])[:, 0]
        total = total - (logp * mask[row, 1:n]).sum()
    (total / mask.sum()).backward()
    with torch.no_grad():
        return {k: p - p.grad for k, p in model.named_parameters()}


def test_the_prefix_is_what_comes_before_the_first_wanted_logprob():
    data = grouped_batch()
    wanted = loss_token_mask(data) > 0
    prefix = prefix_lengths(wanted, data["input_lengths"])
    assert prefix[:12].tolist() == [4, 4, 0, 4] + [8] * 4 + [11] * 4
    assert prefix[2] == 0 and prefix[12] == 0  # nothing wanted; loss from token 1
    firsts, group = shared_prefixes(data["input_ids"], prefix)
    assert firsts == [0, 4, 8] and group == [0, 0, -1, 0, 1, 1, 1, 1, 2, 2, 2, 2, -1]


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_shared_prefix_logprobs_equal_the_plain_forward(chunk):
    data = grouped_batch()
    model = initial_model()
    wanted = loss_token_mask(data) > 0
    with torch.no_grad():
        plain = forward.forward_logprobs(model, data, packed=False, temperature=0.7)
        shared = forward.forward_logprobs(
            model, data, False, chunk_size=chunk, temperature=0.7, wanted=wanted, share_prefix=True
        )
    torch.testing.assert_close(shared, plain * wanted, rtol=0, atol=1e-12)
    assert (shared[wanted] != 0).all()


def test_a_step_with_shared_prompts_equals_the_float64_reference_and_runs_prompts_once(
    float64_norms,
):
    data = grouped_batch()
    worker = DTensorPolicyWorker(tiny_config(train_micro_batch_size=13, train_global_batch_size=13))
    embedded = []
    embed = worker.model.get_input_embeddings()
    embed.register_forward_pre_hook(lambda _m, args: embedded.append(int(args[0].numel())))
    worker.train(data, NLLLoss())
    got = {k: p.detach() for k, p in worker.model.named_parameters()}
    expected = reference_step(data)
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) < 1e-10
    # One pass over the three prompts once (4 + 8 + 11 tokens) and every row's other tokens.
    prefix = [4, 4, 0, 4] + [8] * 4 + [11] * 4 + [0]
    assert embedded == [int(data["input_lengths"].sum()) - sum(prefix) + 4 + 8 + 11]
    assert embedded[0] < data["input_ids"].numel() // 2


def test_sharing_can_be_turned_off():
    data = grouped_batch()
    worker = DTensorPolicyWorker(
        tiny_config(
            train_micro_batch_size=13, train_global_batch_size=13, share_prompt_prefix=False
        )
    )
    embedded = []
    worker.model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: embedded.append(int(args[0].numel()))
    )
    worker.train(data, NLLLoss())
    assert embedded == [data["input_ids"].numel()]
