"""DPO and Bradley-Terry losses against float64 references written pair by pair."""

import pytest
import torch

from rl_algorithms.losses import BradleyTerryLoss, DPOLoss, DPOLossConfig, NLLLoss
from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict


def preference_batch(pairs: int = 4, seed: int = 0) -> tuple[torch.Tensor, BatchedDataDict]:
    """Interleaved rows (2i chosen, 2i+1 rejected), responses from position 3 on."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 10, (2 * pairs,), generator=g)
    S = int(lengths.max())
    real = torch.arange(S)[None, :] < lengths[:, None]
    logprobs = -torch.rand(2 * pairs, S, generator=g, dtype=torch.float64) * 4 * real
    ref = logprobs + torch.randn(2 * pairs, S, generator=g, dtype=torch.float64) * 0.3
    sample_mask = torch.ones(2 * pairs)
    sample_mask[2:4] = 0  # pair 1 is out of the loss (e.g. over length)
    data = BatchedDataDict(
        input_ids=torch.randint(1, 50, (2 * pairs, S), generator=g) * real,
        input_lengths=lengths,
        loss_mask=((torch.arange(S)[None, :] >= 3) & real).double(),
        sample_mask=sample_mask,
        reference_logprobs=ref * real,
        idx=torch.arange(pairs).repeat_interleave(2),
    )
    return logprobs.requires_grad_(True), data


def counts(data):
    return TrainBatch.from_transport(data).sample_valid_mask().sum(), TrainBatch.from_transport(
        data
    ).loss_token_mask().sum()


def reference_dpo(lp, data, cfg: DPOLossConfig):
    beta = cfg.reference_policy_kl_penalty
    pref, sft, pairs = 0.0, 0.0, 0
    for i in range(lp.shape[0] // 2):
        if data["sample_mask"][2 * i] == 0:
            continue
        pairs += 1
        ratios, nlls = [], []
        for row in (2 * i, 2 * i + 1):
            tokens = [
                t for t in range(1, int(data["input_lengths"][row])) if data["loss_mask"][row, t]
            ]
            total = sum(lp[row, t] - data["reference_logprobs"][row, t] for t in tokens)
            ratios.append(total / len(tokens) if cfg.preference_average_log_probs else total)
            nll = -sum(lp[row, t] for t in tokens)
            nlls.append(nll / len(tokens) if cfg.sft_average_log_probs else nll)
        margin = beta * (ratios[0] - ratios[1])
        pref = pref + torch.log1p(torch.exp(-margin))  # -log sigmoid(margin)
        sft = sft + nlls[0]
    return cfg.preference_loss_weight * pref / pairs + cfg.sft_loss_weight * sft / pairs


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"reference_policy_kl_penalty": 0.5, "preference_average_log_probs": True},
        {"sft_loss_weight": 0.3, "preference_loss_weight": 0.7},
        {"sft_loss_weight": 1.0, "sft_average_log_probs": True},
    ],
)
def test_dpo_matches_the_reference_with_gradients(config):
    cfg = DPOLossConfig.model_validate(config)
    lp, data = preference_batch()
    loss, metrics = DPOLoss(cfg)(lp, TrainBatch.from_transport(data), *counts(data))
    expected = reference_dpo(lp, data, cfg)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    (grad,) = torch.autograd.grad(loss, lp)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert metrics["num_valid_pairs"] == 3
    assert 0.0 <= metrics["accuracy"] <= 1.0


def test_dpo_accuracy_and_rewards_are_per_pair():
    lp, data = preference_batch()
    data["reference_logprobs"] = torch.zeros_like(lp)
    _, metrics = DPOLoss({"reference_policy_kl_penalty": 1.0})(
        lp, TrainBatch.from_transport(data), *counts(data)
    )
    mask = TrainBatch.from_transport(data).loss_token_mask()
    rewards = (lp.detach() * mask).sum(dim=1)
    kept = [0, 2, 3]
    right = sum(float(rewards[2 * i] > rewards[2 * i + 1]) for i in kept) / 3
    assert metrics["accuracy"] == pytest.approx(right)
    assert metrics["rewards_chosen_mean"] == pytest.approx(
        sum(float(rewards[2 * i]) for i in kept) / 3
    )


def test_dpo_micro_batches_of_pairs_add_up_to_the_whole_batch():
    lp, data = preference_batch(pairs=5, seed=1)
    loss_fn = DPOLoss({"sft_loss_weight": 0.5})
    whole, _ = loss_fn(lp, TrainBatch.from_transport(data), *counts(data))
    (whole_grad,) = torch.autograd.grad(whole, lp)
    total = sum(
        loss_fn(lp[s:e], TrainBatch.from_transport(data.slice(s, e)), *counts(data))[0]
        for s, e in [(0, 2), (2, 8), (8, 10)]
    )
    (grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-14)


def test_dpo_refuses_batches_cut_across_pairs():
    lp, data = preference_batch()
    with pytest.raises(ValueError, match="cannot hold whole"):
        DPOLoss()(lp[:3], TrainBatch.from_transport(data.slice(0, 3)), *counts(data))
    with pytest.raises(ValueError, match="same pair"):
        DPOLoss()(lp[1:5], TrainBatch.from_transport(data.slice(1, 5)), *counts(data))


@pytest.mark.parametrize("loss_fn", [DPOLoss(), BradleyTerryLoss()], ids=["dpo", "bt"])
def test_a_pair_masked_on_one_side_only_is_refused(loss_fn):
    """``sample_mask`` is the pair's multiplier, equal on both rows: a pair masked on one side
    would be kept as half a pair (the loss reads the chosen row's mask only)."""
    lp, data = preference_batch()
    data["sample_mask"][5] = 0  # pair 2's rejected row only
    scores = lp[:, :2] if isinstance(loss_fn, BradleyTerryLoss) else lp
    with pytest.raises(
        ValueError, match=r"pair 2 \(rows 4 and 5, idx 2\).*sample_mask 1.0 and 0.0"
    ):
        loss_fn(scores, TrainBatch.from_transport(data), *counts(data))
    # A later micro-batch names the pair by its row in that micro-batch and by its dataset idx.
    with pytest.raises(ValueError, match=r"pair 1 \(rows 2 and 3, idx 2\)"):
        loss_fn(scores[2:6], TrainBatch.from_transport(data.slice(2, 6)), *counts(data))


def reference_bradley_terry(scores, data):
    total, pairs, right = 0.0, 0, 0
    for i in range(scores.shape[0] // 2):
        if data["sample_mask"][2 * i] == 0:
            continue
        pairs += 1
        margin = scores[2 * i, 0] - scores[2 * i + 1, 0]
        total = total + torch.log1p(torch.exp(-margin))
        right += float(margin > 0)
    return total / pairs, right / pairs


def test_bradley_terry_matches_the_reference_and_splits():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(10, 2, generator=g, dtype=torch.float64, requires_grad=True)
    _, data = preference_batch(pairs=5)
    loss, metrics = BradleyTerryLoss()(scores, TrainBatch.from_transport(data), *counts(data))
    expected, accuracy = reference_bradley_terry(scores, data)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert metrics["accuracy"] == pytest.approx(accuracy)
    (grad,) = torch.autograd.grad(loss, scores)
    (expected_grad,) = torch.autograd.grad(expected, scores)
    torch.testing.assert_close(grad, expected_grad)
    assert float(grad[:, 1].abs().sum()) == 0.0  # only the first label is the reward
    total = sum(
        BradleyTerryLoss()(scores[s:e], TrainBatch.from_transport(data.slice(s, e)), *counts(data))[
            0
        ]
        for s, e in [(0, 4), (4, 10)]
    )
    assert total.item() == pytest.approx(loss.item(), rel=1e-12)


def test_bradley_terry_asks_for_a_sequence_classifier():
    lp, data = preference_batch()
    with pytest.raises(ValueError, match="sequence_classification"):
        BradleyTerryLoss()(lp.unsqueeze(-1), TrainBatch.from_transport(data), *counts(data))


def test_nll_is_the_mean_over_loss_tokens_of_the_global_batch():
    lp, data = preference_batch()
    loss, _ = NLLLoss()(lp, TrainBatch.from_transport(data), *counts(data))
    terms = [
        -lp[b, t]
        for b in range(lp.shape[0])
        for t in range(1, int(data["input_lengths"][b]))
        if data["loss_mask"][b, t] and data["sample_mask"][b]
    ]
    assert loss.item() == pytest.approx((sum(terms) / len(terms)).item(), rel=1e-12)
