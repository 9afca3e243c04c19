"""No Megatron rank materialises the whole model (real mcore workers, 2 ranks, CPU gloo).

Each rank allocates only its ``GPTModel`` piece and fills it from slices cut from the HF
initialisation run one module at a time (``model.hf_config``). The gathered weights must still
equal the HF model bit for bit. (Loading slices from the safetensors files, ``model.path``, is
checked on the workers of ``test_megatron_parallel.py``.)
"""

import pytest
import torch

import rl_models.megatron  # noqa: F401  (registers rl_models.megatron -> the mcore env)
from rl_distributed import RayVirtualCluster
from rl_models.policy.lm_policy import Policy

from .conftest import TINY_LLAMA, initial_model, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


# One layout (a case costs ~1-2 min here); test_megatron_loading.py checks both sources for
# every layout without workers.
@pytest.mark.timeout(900)
def test_each_rank_builds_and_initialises_only_its_shard():
    model = {"hf_config": TINY_LLAMA, "dtype": "float64"}
    expected = initial_model(seed=5)
    expected_state = expected.state_dict()
    full_bytes = sum(t.numel() * t.element_size() for t in expected_state.values())
    largest = max(t.numel() * t.element_size() for t in expected_state.values())
    megatron = {"pipeline_parallel_size": 2}
    config = tiny_config(model=model, backend="megatron", megatron=megatron, seed=5)
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, config)
    try:
        stats = policy.worker_group.call_all("weight_load_stats")
        gathered = policy.worker_group.call_all("hf_state_dict")[0]
    finally:
        policy.shutdown()
        cluster.shutdown()

    assert set(gathered) == set(expected_state)
    for name, tensor in expected_state.items():
        assert torch.equal(gathered[name], tensor), name
    for rank_stats in stats:
        # Each rank's model piece and what it loaded are about half of the model.
        assert rank_stats["model_piece_numel"] * 8 < 0.8 * full_bytes
        assert rank_stats["bytes_emitted"] == rank_stats["model_piece_numel"] * 8
        assert rank_stats["bytes_read"] == 0
        # Whole HF tensors were held at most two at a time (up_proj while gate_proj's part
        # waits for it), never the whole model; each once, so at least the largest.
        assert largest <= rank_stats["peak_full_bytes"] <= 2 * largest < full_bytes / 4
