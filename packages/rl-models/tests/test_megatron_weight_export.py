"""Weight export from a real Megatron-core policy (mcore environment, 2 ranks, CPU gloo)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import rl_models.megatron  # noqa: F401  (registers rl_models.megatron -> the mcore env)
from rl_distributed import RayVirtualCluster
from rl_models.policy.lm_policy import Policy
from rl_models.weight_transfer.buckets import unpack_bucket

from .conftest import tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_megatron_export_equals_the_hf_state_dict_without_a_full_gather(tiny_llama, tp, pp):
    config = tiny_config(
        model={"path": tiny_llama, "dtype": "float64"},
        backend="megatron",
        megatron={"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
    )
    expected = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64).state_dict()
    model_bytes = sum(t.numel() * 8 for t in expected.values())
    bucket_bytes = model_bytes // 10
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, config)
    try:
        group = policy.worker_group
        plans = group.call_all("weight_export_plan", bucket_bytes=bucket_bytes)
        got: dict[int, dict[str, torch.Tensor]] = {0: {}, 1: {}}
        for step in range(max(p.steps for p in plans)):
            for rank, bucket in enumerate(group.call_all("export_weight_bucket", step=step)):
                if bucket is None:
                    continue
                assert bucket.nbytes <= bucket_bytes or len(bucket.slots) == 1
                got[rank].update((n, t.clone()) for n, t in unpack_bucket(bucket))
        stats = group.call_all("finish_weight_export")
    finally:
        policy.shutdown()
        cluster.shutdown()
    if tp == 2:  # tensor-parallel rank 0 produces everything, rank 1 only sends its shards
        assert [p.producer for p in plans] == [True, False] and not got[1]
    else:  # each pipeline stage exports its own layers
        assert all(p.producer for p in plans)
        assert all(".layers.0." in n or "embed" in n for n in got[0])
        assert all(
            ".layers.1." in n or n in ("model.norm.weight", "lm_head.weight") for n in got[1]
        )
    merged = {**got[0], **got[1]}
    assert set(merged) == set(expected)
    for name, t in expected.items():
        assert torch.equal(merged[name], t), name
    # No rank ever held more than one unit (here: one decoder layer) of full tensors.
    layer_bytes = sum(t.numel() * 8 for n, t in expected.items() if ".layers.0." in n)
    assert layer_bytes < model_bytes / 2
    for rank_stats in stats:
        assert rank_stats["peak_held_bytes"] <= layer_bytes
