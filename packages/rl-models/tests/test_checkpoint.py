from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import skewed_batch, tiny_config

# Adam keeps per-parameter state and the schedule changes the lr every step: both must be saved
# for training to continue as if it had never stopped.
CONFIG = {
    "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-2}},
    "scheduler": {"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.5}},
    "max_grad_norm": 1.0,
}


def state_dir(path) -> str:
    """Where ``saved`` put the optimiser and scheduler state: beside the model, as a run's
    checkpoint does."""
    return str(path.parent / f"{path.name}-state")


@pytest.fixture(scope="module", params=[False, True], ids=["full", "sharded"])
def saved(tmp_path_factory, request):
    """A worker trained one step, checkpointed, then trained one step more."""
    path = tmp_path_factory.mktemp("ckpt")
    worker = DTensorPolicyWorker(tiny_config(**CONFIG, checkpoint={"sharded": request.param}))
    worker.train(skewed_batch(seed=1), NLLLoss())
    worker.save_checkpoint(str(path), state_dir(path))
    logprobs = worker.get_logprobs(skewed_batch())["logprobs"]
    metrics = worker.train(skewed_batch(seed=2), NLLLoss()).metrics
    return path, logprobs, metrics, worker.model.state_dict()


def test_checkpoint_loads_with_plain_transformers(saved):
    path, logprobs, _, _ = saved
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    data = skewed_batch()
    ids, n = data["input_ids"][1], int(data["input_lengths"][1])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None, :n]).logits[0], dim=-1)
    expected = logp[:-1].gather(-1, ids[1:n, None])[:, 0]
    torch.testing.assert_close(logprobs[1, 1:n], expected, rtol=0, atol=1e-10)


def test_training_resumes_identically_after_loading(saved):
    path, _, metrics, weights = saved
    fresh = DTensorPolicyWorker(tiny_config(**CONFIG, seed=123))  # other initial weights
    # Either layout loads whatever the worker's own checkpoint setting.
    fresh.load_checkpoint(str(path), state_dir(path))
    resumed = fresh.train(skewed_batch(seed=2), NLLLoss()).metrics
    assert resumed["lr"] == metrics["lr"] == [pytest.approx(5e-3)]
    assert resumed["loss"] == pytest.approx(metrics["loss"], abs=1e-12)
    got = fresh.model.state_dict()
    assert max(float((got[k] - weights[k]).abs().max()) for k in weights) < 1e-12


@pytest.mark.parametrize("fused", [True, False], ids=["to-fused", "to-for-loop"])
def test_a_resumed_optimizer_runs_the_kernel_its_config_asks_for(saved, fused):
    """The checkpoint was saved by a for-loop AdamW; resumed with ``fused: true`` (or with the
    flag given as false), the step runs that kernel, and trains as the uninterrupted run did."""
    path, _, metrics, weights = saved
    optimizer = {**CONFIG["optimizer"], "kwargs": {**CONFIG["optimizer"]["kwargs"], "fused": fused}}
    fresh = DTensorPolicyWorker(tiny_config(**{**CONFIG, "optimizer": optimizer}, seed=123))
    fresh.load_checkpoint(str(path), state_dir(path))
    assert all(group["fused"] is fused for group in fresh.optimizer.param_groups)
    resumed = fresh.train(skewed_batch(seed=2), NLLLoss()).metrics
    assert resumed["loss"] == pytest.approx(metrics["loss"], abs=1e-12)
    got = fresh.model.state_dict()
    assert max(float((got[k] - weights[k]).abs().max()) for k in weights) < 1e-12


def test_the_model_folder_holds_the_model_and_the_state_folder_the_rest(saved):
    path, _, _, _ = saved
    model_files = {p.name for p in path.iterdir()}
    assert "config.json" in model_files
    assert not model_files & {"optimizer.pt", "optimizer", "scheduler.pt"}, model_files
    state_files = {p.name for p in Path(state_dir(path)).iterdir()}
    assert "scheduler.pt" in state_files and state_files & {"optimizer.pt", "optimizer"}


def test_without_optimizer_state_training_would_differ(saved):
    path, _, _, weights = saved
    fresh = DTensorPolicyWorker(tiny_config(**CONFIG))
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    fresh.model.load_state_dict(reloaded.state_dict())  # weights only: Adam restarts
    fresh.train(skewed_batch(seed=2), NLLLoss())
    got = fresh.model.state_dict()
    assert max(float((got[k] - weights[k]).abs().max()) for k in weights) > 1e-4


@pytest.mark.ray
def test_sharded_checkpoint_of_two_ranks_resumes_on_one(ray_session, tmp_path):
    """Each FSDP rank writes its own shards; the consolidated weights load with plain HF, and
    a single process resumes from them (DCP reshards the optimiser state on load)."""
    from rl_distributed.virtual_cluster import RayVirtualCluster
    from rl_models.policy.lm_policy import Policy

    config = tiny_config(**CONFIG, train_micro_batch_size=2, checkpoint={"sharded": True})
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, config)
    try:
        policy.train(skewed_batch(seed=1), NLLLoss())
        policy.save_checkpoint(str(tmp_path))
        metrics = policy.train(skewed_batch(seed=2), NLLLoss()).metrics
        after = policy.get_logprobs(skewed_batch())["logprobs"]
    finally:
        policy.shutdown()
        cluster.shutdown()

    shard_files = list((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shard_files) == 2, shard_files  # one per rank: nobody gathered the model
    AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)  # plain HF loads it

    single = DTensorPolicyWorker(tiny_config(**CONFIG, train_micro_batch_size=2, seed=7))
    single.load_checkpoint(str(tmp_path))
    resumed = single.train(skewed_batch(seed=2), NLLLoss()).metrics
    assert resumed["lr"] == metrics["lr"]
    assert resumed["loss"] == pytest.approx(metrics["loss"], abs=1e-9)
    got = single.get_logprobs(skewed_batch())["logprobs"]
    torch.testing.assert_close(got, after, rtol=0, atol=1e-6)


def test_a_megatron_resume_under_other_parallel_sizes_names_the_keys(tmp_path):
    """The optimiser state of a Megatron checkpoint is split per parallel rank: resuming with
    another expert_parallel_size (or tp, pp) is refused up front, naming the key and both
    values, instead of a missing file or torch's param-group error. A checkpoint saved before
    the sizes were recorded is judged by whether this rank's optimiser file exists."""
    from rl_models.megatron.training_state import check_parallel_layout, save_parallel_layout

    saved = {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "expert_parallel_size": 2}
    save_parallel_layout(str(tmp_path), saved)
    check_parallel_layout(str(tmp_path), saved, "optimizer-pp0-tp0-ep0.pt")  # same: fine
    run = {**saved, "expert_parallel_size": 4}
    message = r"policy\.megatron\.expert_parallel_size: checkpoint 2, this run 4"
    with pytest.raises(ValueError, match=message) as refused:
        check_parallel_layout(str(tmp_path), run, "optimizer-pp0-tp0-ep3.pt")
    assert "tensor_parallel_size" not in str(refused.value)  # only what differs
    both = {**run, "tensor_parallel_size": 2}
    with pytest.raises(ValueError, match=r"tensor_parallel_size: checkpoint 1, this run 2; "):
        check_parallel_layout(str(tmp_path), both, "optimizer-pp0-tp1-ep3.pt")

    older = tmp_path / "older"  # no recorded sizes: the files tell
    older.mkdir()
    (older / "optimizer-pp0-tp0-ep0.pt").write_bytes(b"")
    check_parallel_layout(str(older), saved, "optimizer-pp0-tp0-ep0.pt")
    with pytest.raises(FileNotFoundError, match=r"saved under other policy\.megatron parallel"):
        check_parallel_layout(str(older), run, "optimizer-pp0-tp0-ep3.pt")
