import pytest
import torch

from rl_data.batch import TrainBatch
from rl_models.losses import NLLLoss
from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import TINY_LLAMA, initial_model, skewed_batch, tiny_config


def reference_logprobs(data, seed: int = 0) -> torch.Tensor:
    """Plain PyTorch: each sequence alone, unpadded, forward -> log_softmax -> gather."""
    model = initial_model(seed).eval()
    out = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
            ids = ids[:n]
            logp = torch.log_softmax(model(ids[None]).logits[0], dim=-1)
            out[row, 1:n] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
    return out


@pytest.mark.parametrize("micro_batch_size", [1, 3, 8])
def test_logprobs_match_a_plain_pytorch_reference(micro_batch_size):
    data = skewed_batch()
    worker = DTensorPolicyWorker(tiny_config(logprob_micro_batch_size=micro_batch_size))
    got = worker.get_logprobs(data)["logprobs"]
    assert got.shape == data["input_ids"].shape
    torch.testing.assert_close(got, reference_logprobs(data), rtol=0, atol=1e-10)
    assert (got[:, 0] == 0).all()
    padding = torch.arange(got.shape[1])[None] >= data["input_lengths"][:, None]
    assert (got[padding] == 0).all() and (got[~padding][1:] < 0).any()


@pytest.mark.parametrize("budget", [61, 70, 200])
def test_packed_logprobs_equal_unpacked(budget):
    data = skewed_batch()
    packed = DTensorPolicyWorker(
        tiny_config(sequence_packing={"enabled": True, "max_tokens_per_microbatch": budget})
    )
    rows = []
    packed.model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    got = packed.get_logprobs(data)["logprobs"]
    assert rows and set(rows) == {1}  # every forward pass saw one packed row
    assert len(rows) < data.size
    torch.testing.assert_close(got, reference_logprobs(data), rtol=0, atol=1e-10)


def test_dynamic_batches_are_cut_to_their_own_longest_row():
    data = skewed_batch()
    worker = DTensorPolicyWorker(
        tiny_config(dynamic_batching={"enabled": True, "train_mb_tokens": 64})
    )
    shapes = []
    worker.model.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    got = worker.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(got, reference_logprobs(data), rtol=0, atol=1e-10)
    assert all(rows * width <= 64 for rows, width in shapes if rows > 1)
    assert len({rows for rows, _ in shapes}) > 1  # row counts vary with length...
    assert sum(rows * width for rows, width in shapes) < data.size * 61 / 2  # ...padding shrinks


def test_reference_policy_keeps_the_initial_weights():
    data = skewed_batch()
    worker = DTensorPolicyWorker(tiny_config(reference_policy={"enabled": True}))
    before = worker.get_logprobs(data)["logprobs"]
    worker.train(data, NLLLoss())
    after = worker.get_logprobs(data)["logprobs"]
    reference = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
    assert (after - before).abs().max() > 1e-3  # training moved the policy...
    torch.testing.assert_close(reference, before, rtol=0, atol=1e-12)  # ...not the reference
    assert next(worker.reference.parameters()).device.type == "cpu"


def test_eval_mode_reports_the_loss_without_updating():
    data = skewed_batch()
    worker = DTensorPolicyWorker(tiny_config())
    before = worker.get_logprobs(data)["logprobs"]
    metrics = worker.train(data, NLLLoss(), eval_mode=True).metrics
    torch.testing.assert_close(worker.get_logprobs(data)["logprobs"], before, rtol=0, atol=0)
    # The NLL of the loss tokens is the mean of their negated log-probs.

    mask = TrainBatch.from_transport(data).loss_token_mask()
    assert metrics["loss"][0] == pytest.approx(float(-(before * mask).sum() / mask.sum()))
    assert metrics["global_valid_toks"] == [float(mask.sum())]
    assert "grad_norm" not in metrics


def test_training_lowers_the_loss_with_clipping_and_a_schedule():
    data = skewed_batch()
    worker = DTensorPolicyWorker(
        tiny_config(
            optimizer={"name": "AdamW", "kwargs": {"lr": 1e-2}},
            scheduler={
                "name": "LinearLR",
                "kwargs": {"start_factor": 1.0, "end_factor": 0.5, "total_iters": 4},
            },
            max_grad_norm=0.5,
            train_global_batch_size=4,
            train_micro_batch_size=2,
        )
    )
    losses, lrs = [], []
    for _ in range(3):
        metrics = worker.train(data, NLLLoss()).metrics
        assert len(metrics["loss"]) == 2  # 8 rows, global batches of 4: two steps
        losses += metrics["loss"]
        lrs += metrics["lr"]
    # Per pass over the data, the mean loss of its two global batches falls clearly.
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.4
    assert lrs[0] == pytest.approx(1e-2) and lrs[-1] < lrs[0]


def test_activation_checkpointing_gives_the_same_gradients():
    data = skewed_batch()
    plain = DTensorPolicyWorker(tiny_config())
    ckpt = DTensorPolicyWorker(tiny_config(activation_checkpointing=True))
    plain.train(data, NLLLoss())
    ckpt.train(data, NLLLoss())
    a, b = plain.model.state_dict(), ckpt.model.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-12


def test_bfloat16_mixed_precision_computes_in_bf16_and_keeps_float32_weights():
    data = skewed_batch()
    model = {"hf_config": TINY_LLAMA, "dtype": "float32"}
    full = DTensorPolicyWorker(tiny_config(model=model))
    mixed = DTensorPolicyWorker(tiny_config(model=model, mixed_precision="bfloat16"))
    seen = []
    layer = mixed.model.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    lp_full, lp_mixed = (w.get_logprobs(data)["logprobs"] for w in (full, mixed))
    assert seen == [torch.bfloat16] and lp_mixed.dtype == torch.float32
    # bf16 keeps ~3 significant digits: close to float32, and not identical to it.
    assert 0 < float((lp_full - lp_mixed).abs().max()) < 0.05
    loss_full, loss_mixed = (w.train(data, NLLLoss()).metrics["loss"][0] for w in (full, mixed))
    assert loss_mixed == pytest.approx(loss_full, rel=1e-2)
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}
    after_full, after_mixed = (w.get_logprobs(data)["logprobs"] for w in (full, mixed))
    assert float((after_full - after_mixed).abs().max()) < 0.05


def test_config_rejects_mistakes_early():
    with pytest.raises(ValueError, match=r"torch\.optim has no 'Adamm'; did you mean 'Adam'"):
        tiny_config(optimizer={"name": "Adamm"})
    with pytest.raises(ValueError, match="exactly one"):
        PolicyConfig.model_validate({"model": {}, "train_global_batch_size": 1})
    with pytest.raises(ValueError, match="sequence_packing or dynamic_batching, not both"):
        tiny_config(sequence_packing={"enabled": True}, dynamic_batching={"enabled": True})
    with pytest.raises(ValueError, match=r"megatron' does not support lora\.enabled"):
        tiny_config(backend="megatron", lora={"enabled": True})
    with pytest.raises(ValueError, match=r"megatron\.\* settings need backend: megatron"):
        tiny_config(megatron={"tensor_parallel_size": 2})
