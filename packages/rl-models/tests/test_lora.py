"""LoRA through peft: only the adapters train, the base stays the reference, checkpoints load."""

import os

import pytest
import torch
from safetensors.torch import load_file
from torch.func import functional_call
from transformers import AutoModelForCausalLM

from rl_data.batch import TrainBatch
from rl_models.losses import NLLLoss
from rl_models.modeling.build import build_model
from rl_models.modeling.lora import ADAPTER_DIR
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import run_ranks, skewed_batch, tiny_config

LORA = {"enabled": True, "rank": 4, "alpha": 8.0}
ADAM = {"name": "AdamW", "kwargs": {"lr": 1e-2}}


def base_model() -> torch.nn.Module:
    """The model a worker of ``tiny_config()`` starts from (before any adapter)."""
    cfg = tiny_config()
    return build_model(cfg.model, cfg.seed)


def lora_worker(**overrides) -> DTensorPolicyWorker:
    return DTensorPolicyWorker(tiny_config(lora=LORA, **overrides))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def next_token_logprobs(model: torch.nn.Module, data) -> torch.Tensor:
    """Per-row log-probs of plain forward passes (no padding, no packing), padded like ours."""
    out = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        lengths = data["input_lengths"].tolist()
        for row, (ids, n) in enumerate(zip(data["input_ids"], lengths, strict=True)):
            logp = torch.log_softmax(model(input_ids=ids[None, :n]).logits[0], dim=-1)
            out[row, 1:n] = logp[:-1].gather(-1, ids[1:n, None])[:, 0]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA worker trained three Adam steps, then checkpointed."""
    path = tmp_path_factory.mktemp("lora")
    worker = lora_worker(optimizer=ADAM, reference_policy={"enabled": True})
    before = snapshot(worker.model)
    data = skewed_batch()
    losses = [worker.train(data, NLLLoss()).metrics["loss"][0] for _ in range(3)]
    worker.save_checkpoint(str(path))
    return worker, before, losses, path


def test_only_the_adapters_are_trainable_and_optimised(trained):
    worker = trained[0]
    trainable = {n for n, p in worker.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimised = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for p in worker.model.parameters() if p.requires_grad}


def test_only_lora_weights_change_and_the_base_stays_bit_identical(trained):
    worker, before, _, _ = trained
    after = snapshot(worker.model)
    assert set(after) == set(before)
    lora_keys = [k for k in after if ".lora_" in k]
    assert lora_keys
    for key in after:
        if key in lora_keys:
            assert not torch.equal(after[key], before[key]), key
        else:
            assert torch.equal(after[key], before[key]), key


def test_loss_decreases(trained):
    losses = trained[2]
    assert losses[0] > losses[1] > losses[2]


def test_reference_logprobs_are_the_pretrained_models(trained):
    worker = trained[0]
    data = skewed_batch()
    pretrained = DTensorPolicyWorker(tiny_config()).get_logprobs(data)["logprobs"]
    reference = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
    torch.testing.assert_close(reference, pretrained, rtol=0, atol=1e-12)
    assert worker.reference is None  # no deep copy was made
    current = worker.get_logprobs(data)["logprobs"]
    assert float((current - reference).abs().max()) > 1e-3  # the adapters are back on


def test_merged_checkpoint_loads_with_plain_transformers(trained):
    worker, _, _, path = trained
    data = skewed_batch()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    assert not any("lora" in k for k in model.state_dict())
    expected = worker.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(next_token_logprobs(model, data), expected, rtol=0, atol=1e-10)


def test_adapter_checkpoint_loads_with_peft(trained):
    from peft import PeftModel

    worker, _, _, path = trained
    data = skewed_batch()
    base = base_model()
    model = PeftModel.from_pretrained(base, os.path.join(path, ADAPTER_DIR)).eval()
    expected = worker.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(next_token_logprobs(model, data), expected, rtol=0, atol=1e-10)


def test_training_resumes_identically_after_loading(trained):
    worker, _, _, path = trained
    fresh = lora_worker(optimizer=ADAM, reference_policy={"enabled": True})
    fresh.load_checkpoint(str(path))
    resumed = snapshot(fresh.model)
    for key, value in snapshot(worker.model).items():
        assert torch.equal(resumed[key], value), key


def test_adapters_start_from_the_policy_seed_whatever_the_global_generator(tmp_path):
    """A model loaded from files draws nothing from ``seed`` before peft adds its adapters, and
    torch seeds its global generator at random in every process. The adapters must still come
    from the policy's seed alone, or two runs of one config (and the ranks of one run) start
    from different adapters."""
    base_model().save_pretrained(tmp_path)

    def adapters(global_seed: int, seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        model = {"path": str(tmp_path), "dtype": "float64"}
        worker = DTensorPolicyWorker(tiny_config(lora=LORA, model=model, seed=seed))
        assert torch.equal(torch.get_rng_state(), state)  # the caller's generator is left alone
        return {k: v for k, v in snapshot(worker.model).items() if ".lora_A." in k}

    first, again, other = adapters(1, seed=0), adapters(2, seed=0), adapters(1, seed=1)
    assert len(first) == 2 * 7 and first.keys() == again.keys() == other.keys()
    for key, value in first.items():
        assert torch.equal(value, again[key]), key
        assert not torch.equal(value, other[key]), key


def test_lora_gradient_matches_a_hand_built_float64_lora():
    """One SGD step with lr=1 moves A and B by minus their gradients; recompute them by hand.

    The hand version is the plain transformers model with every adapted weight replaced by
    ``W + (alpha / r) * B @ A`` (autograd on A and B only) and the NLL written out directly.
    """
    worker = lora_worker()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B starts at zero, which would zero A's gradient: make it random
        for name, p in worker.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    before = snapshot(worker.model)
    data = skewed_batch()
    worker.train(data, NLLLoss())
    after = snapshot(worker.model)

    plain = base_model()
    scaling = LORA["alpha"] / LORA["rank"]
    leaves, weights = {}, {}
    for key, value in before.items():
        if ".lora_A." not in key:
            continue
        prefix = key.split(".lora_A.")[0]
        a = value.clone().requires_grad_(True)
        b = before[f"{prefix}.lora_B.default.weight"].clone().requires_grad_(True)
        leaves[prefix] = (a, b)
        w = before[f"{prefix}.base_layer.weight"]
        weights[prefix.removeprefix("base_model.model.") + ".weight"] = w + scaling * b @ a
    ids, lengths = data["input_ids"], data["input_lengths"]
    real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    logits = functional_call(plain, weights, (ids,), {"attention_mask": real.long()}).logits
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = TrainBatch.from_transport(data).loss_token_mask()[:, 1:]
    (-(logp * mask).sum() / mask.sum()).backward()

    assert len(leaves) == 2 * 7  # two layers, seven projections each
    for prefix, (a, b) in leaves.items():
        for leaf, grad in (("lora_A", a.grad), ("lora_B", b.grad)):
            key = f"{prefix}.{leaf}.default.weight"
            step = before[key] - after[key]
            assert float(grad.abs().max()) > 1e-6, key
            torch.testing.assert_close(step, grad, rtol=0, atol=1e-10)


# Each rank of the FSDP2 test runs this under torchrun (spawned test functions cannot be
# unpickled from the tests package): argv is the policy config (JSON) and the checkpoint path.
RANK_SCRIPT = """
import json, os, sys
from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_distributed.batched_data_dict import BatchedDataDict
import torch

worker = DTensorPolicyWorker(json.loads(sys.argv[1]))
data = BatchedDataDict(torch.load(sys.argv[2]))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
rows = data.size // world
worker.train(data.slice(rank * rows, (rank + 1) * rows), NLLLoss())
worker.save_checkpoint(sys.argv[3])
worker.shutdown()
"""


@pytest.mark.slow
def test_fsdp2_with_lora_gives_the_single_process_step(tmp_path):
    """Two gloo ranks with FSDP2 over the peft model save what one process would."""
    script, data = tmp_path / "rank.py", tmp_path / "data.pt"
    script.write_text(RANK_SCRIPT)
    torch.save(dict(skewed_batch()), data)
    config = tiny_config(lora=LORA, train_micro_batch_size=1).model_dump_json()
    sharded = str(tmp_path / "sharded")
    run_ranks(2, str(script), config, str(data), sharded, timeout=120)
    single = lora_worker()
    single.train(skewed_batch(), NLLLoss())
    single.save_checkpoint(str(tmp_path / "single"))
    for name in ("model.safetensors", f"{ADAPTER_DIR}/adapter_model.safetensors"):
        got = load_file(os.path.join(sharded, name))
        want = load_file(str(tmp_path / "single" / name))
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12)
