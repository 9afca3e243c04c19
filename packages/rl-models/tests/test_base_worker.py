"""The loop both backends share: device choice, micro-batch widths, gradients after a step."""

import ast
import inspect

import pytest
import torch

from rl_data.batch import TrainBatch
from rl_models.interfaces import Max, Min
from rl_models.losses import NLLLoss
from rl_models.policy import base_worker
from rl_models.policy.base_worker import PolicyWorker, local_device
from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.lm_policy import Policy

from .conftest import TINY_LLAMA, skewed_batch, tiny_config
from .test_logprobs import reference_logprobs


def fake_gpus(monkeypatch, visible: int, local_rank: int) -> None:
    """What a process sees on a GPU node (no GPU exists here: only the visibility is faked)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def test_a_ray_worker_with_one_gpu_uses_the_one_it_sees(monkeypatch):
    # Ray gives an actor with num_gpus=1 its own GPU as CUDA_VISIBLE_DEVICES: always cuda:0,
    # whatever its LOCAL_RANK on the node.
    fake_gpus(monkeypatch, visible=1, local_rank=3)
    assert local_device() == torch.device("cuda", 0)


def test_a_process_that_sees_every_gpu_takes_its_local_rank(monkeypatch):
    fake_gpus(monkeypatch, visible=8, local_rank=3)  # torchrun-style launch
    assert local_device() == torch.device("cuda", 3)


def test_a_local_rank_beyond_the_visible_gpus_is_reported(monkeypatch):
    fake_gpus(monkeypatch, visible=2, local_rank=5)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=5 but this process sees only 2 GPUs"):
        local_device()


def test_without_cuda_the_worker_runs_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device() == torch.device("cpu")


def _class_bases(path: str, name: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return [ast.unparse(b) for b in cls.bases]


def test_both_backends_share_the_training_loop_base_class():
    """The Megatron worker (importable only in the mcore environment, hence read as source)
    no longer inherits the DTensor worker's HF code."""
    import rl_models.megatron

    megatron_worker = inspect.getfile(rl_models.megatron).replace("__init__.py", "worker.py")
    megatron_bases = _class_bases(megatron_worker, "MegatronPolicyWorker")
    assert "PolicyWorker" in megatron_bases and "DTensorPolicyWorker" not in megatron_bases
    # Besides the training loop, both take the weight-export methods (a mixin for refit).
    assert issubclass(DTensorPolicyWorker, PolicyWorker)
    assert not inspect.isabstract(DTensorPolicyWorker)


def test_fixed_micro_batches_are_cut_to_their_own_longest_row():
    data = skewed_batch()  # lengths 3, 61, 5, 7, 2, 40, 9, 4
    # Fixed micro-batches explicitly: on CPU the default (`auto`) is dynamic batching.
    config = tiny_config(logprob_micro_batch_size=2, dynamic_batching={"enabled": False})
    worker = DTensorPolicyWorker(config)
    shapes = []
    worker.model.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    got = worker.get_logprobs(data)["logprobs"]
    assert shapes == [(2, 61), (2, 7), (2, 40), (2, 9)]
    torch.testing.assert_close(got, reference_logprobs(data), rtol=0, atol=1e-10)

    shapes.clear()
    worker.train(data, NLLLoss(), mbs=2)
    assert shapes == [(2, 61), (2, 7), (2, 40), (2, 9)]


def test_trimming_keeps_per_row_values():
    data = skewed_batch().slice(2, 4)
    data["target"] = torch.ones(2, 3)  # [B, labels]: not a per-token tensor
    cut = base_worker.trim_to_longest_row(data)
    assert cut["input_ids"].shape == (2, 7) and cut["loss_mask"].shape == (2, 7)
    assert cut["target"].shape == (2, 3)


def test_gradients_are_freed_after_the_optimizer_step():
    worker = DTensorPolicyWorker(tiny_config())
    worker.train(skewed_batch(), NLLLoss())
    assert all(p.grad is None for p in worker.model.parameters())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"lora": {"enabled": True}, "checkpoint": {"sharded": True}},
            "lora.enabled does not work with checkpoint.sharded",
        ),
        (
            {"backend": "megatron", "mixed_precision": "bfloat16"},
            "backend 'megatron' does not support mixed_precision",
        ),
        (
            {"backend": "megatron", "checkpoint": {"sharded": True}},
            "backend 'megatron' does not support checkpoint.sharded",
        ),
    ],
    ids=["lora-sharded", "megatron-bf16", "megatron-sharded"],
)
def test_combinations_that_would_silently_misbehave_are_refused(overrides, message):
    config = {"model": {"hf_config": TINY_LLAMA}, "train_global_batch_size": 8, **overrides}
    with pytest.raises(ValueError, match=message):
        PolicyConfig.model_validate(config)


class RowCountMetrics(NLLLoss):
    """NLL, reporting each micro-batch's row count three ways: as a declared minimum, a declared
    maximum, and a plain float whose name merely ends in ``_min``."""

    def __call__(self, logprobs, data, global_valid_seqs, global_valid_toks):
        loss, _ = super().__call__(logprobs, data, global_valid_seqs, global_valid_toks)
        rows = float(data.size)
        return loss, {"rows_lo": Min(rows), "rows_hi": Max(rows), "rows_min": rows}


def test_loss_metrics_combine_over_micro_batches_as_declared_not_as_named():
    worker = DTensorPolicyWorker(tiny_config(dynamic_batching={"enabled": False}))
    result = worker.train(skewed_batch(), RowCountMetrics(), mbs=3)  # rows 3, 3 and 2
    assert result.metrics["rows_lo"] == [2.0] and isinstance(result.metrics["rows_lo"][0], Min)
    assert result.metrics["rows_hi"] == [3.0] and isinstance(result.metrics["rows_hi"][0], Max)
    assert result.metrics["rows_min"] == [8.0]  # a plain float adds up, whatever its name


def test_train_reports_the_optimizer_steps_it_took():
    worker = DTensorPolicyWorker(tiny_config())
    trained = worker.train(skewed_batch(), NLLLoss(), gbs=4)
    assert trained.optimizer_steps == 2 and len(trained.metrics["grad_norm"]) == 2
    evaluated = worker.train(skewed_batch(), NLLLoss(), eval_mode=True, gbs=4)
    assert evaluated.optimizer_steps == 0 and len(evaluated.metrics["loss"]) == 2


class InProcessWorkers:
    """The worker-group calls ``Policy.train`` makes, answered by one worker in this process."""

    def __init__(self, worker: DTensorPolicyWorker) -> None:
        self.worker = worker

    def run_all_workers_sharded_data(self, method, *, common_kwargs, data, **_):
        (shard,) = data
        return [getattr(self.worker, method)(data=shard, **common_kwargs)]

    def get_all_worker_results(self, futures):
        return futures


def test_the_policy_weight_version_advances_by_the_optimizer_steps():
    policy = Policy.__new__(Policy)
    policy.config = tiny_config()
    policy.worker_group = InProcessWorkers(DTensorPolicyWorker(policy.config))
    policy.dp_size, policy.on_gpu, policy.weight_version = 1, False, 0
    policy.train(skewed_batch(), NLLLoss(), gbs=4)
    assert policy.weight_version == 2
    policy.train(skewed_batch(), NLLLoss(), eval_mode=True, gbs=4)
    assert policy.weight_version == 2


def test_a_train_batch_goes_through_the_policy_and_a_stray_key_is_refused_on_the_driver():
    policy = Policy.__new__(Policy)
    policy.config = tiny_config()
    policy.worker_group = InProcessWorkers(DTensorPolicyWorker(policy.config))
    policy.dp_size, policy.on_gpu, policy.weight_version = 1, False, 0
    data = skewed_batch()
    batch = TrainBatch.from_transport(data)
    # The same rows as a TrainBatch or as their transport train the same step.
    typed = policy.train(batch, NLLLoss(), eval_mode=True, gbs=4).metrics
    plain = policy.train(data, NLLLoss(), eval_mode=True, gbs=4).metrics
    assert typed["loss"] == plain["loss"] and typed["global_valid_toks"][0] > 0
    data["token_mask"] = data["loss_mask"]
    with pytest.raises(ValueError, match="'token_mask' is now 'loss_mask'"):
        policy.train(data, NLLLoss(), gbs=4)
    assert policy.weight_version == 0
