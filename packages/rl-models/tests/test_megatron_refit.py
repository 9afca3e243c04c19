"""A refit from a trained Megatron policy into the HF generator gives the policy's log-probs.

Two CPU ranks (gloo) hold a tiny Qwen3 as two tensor-parallel shards, or a tiny Qwen3-MoE as
two expert-parallel replicas (each holding half of every layer's experts). After one SGD step,
``refit`` streams the trained weights into a ``HfGenerationWorker`` through both CPU channels:
bounded buckets through the object store, then a shared-memory region the ranks write into
(what ``auto`` picks on one node). Each time, the generator's float64 log-probs of fixed
sequences must equal the Megatron worker's own.

The reference is the Megatron model itself (``get_logprobs``), not a transformers model loaded
from a checkpoint of it: a checkpoint goes through the same HF/Megatron name and layout tables
as the export, so a mapping mistake shared by both would pass unseen, while Megatron's forward
never touches them. The generator runs in this process, called by ``refit`` through a
one-worker stand-in for its Ray worker group, so that its model's logits can be read directly
and its experts switched to the eager kernel (transformers' grouped matmul has no float64).

Tolerance ``ATOL`` and its reason as in ``test_megatron_worker.py`` (RoPE angles in float32 on
both sides, cos/sin in float32 in HF and float64 in Megatron). Seen here: 5.2e-8 (Qwen3, tp=2)
and 1.1e-7 (Qwen3-MoE, ep=2), the same through both channels, where the step moved log-probs
by up to 0.82. An export that transposes the (square) key and value projections is off by
0.64; one that joins the tp ranks' fused QKV parts group by group across the ranks (group g
from rank g % tp) rather than rank after rank, by 0.58 (with one key/value group per rank it
would pass); one that swaps the two expert ranks' expert numbers, by 0.03.
"""

from types import SimpleNamespace

import pytest
import ray
import torch

import rl_models.megatron  # noqa: F401  (registers rl_models.megatron -> the mcore env)
from rl_distributed import RayVirtualCluster
from rl_distributed.worker_host import SharedArg
from rl_models.generation.config import GenerationConfig
from rl_models.generation.hf_worker import HfGenerationWorker
from rl_models.generation.refit import refit
from rl_models.losses import NLLLoss
from rl_models.policy.lm_policy import Policy

from .conftest import TINY_QWEN3, save_tiny, sequence_logprobs, skewed_batch, tiny_config
from .test_megatron_parallel import TINY_QWEN3_MOE
from .test_megatron_worker import ATOL

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

#: Each case's model and ``megatron`` section. Tensor parallelism makes the export gather
#: each layer's shards (the fused QKV regrouped per key/value head); expert parallelism makes
#: two ranks send their own experts under their global numbers.
CASES = {
    # Four key/value heads (two query heads each), so each tp rank holds two key/value groups
    # of the fused QKV: the export must join the ranks' parts group after group, where with one
    # group per rank any order of rank and group would give the same tensor.
    "qwen3-tp2": (
        {**TINY_QWEN3, "num_attention_heads": 8, "num_key_value_heads": 4},
        {"tensor_parallel_size": 2},
    ),
    "qwen3_moe-ep2": (TINY_QWEN3_MOE, {"expert_parallel_size": 2}),
}
#: Under a quarter of a decoder layer (about 290 KiB in float64): each layer travels in
#: several buckets.
BUCKET_BYTES = 1 << 16


class OneLocalWorker:
    """The calls ``refit`` makes of a generator's Ray worker group, answered by one worker
    object in this process. Calls run at once, so their "futures" are already the results.
    The placement is the driver's node: that of the policy ranks on this one-node cluster."""

    world_size = 1

    def __init__(self, worker: HfGenerationWorker) -> None:
        self.worker = worker
        node = ray.get_runtime_context().get_node_id()
        self.worker_metadata = [SimpleNamespace(placement={"node_id": node})]

    def call_one(self, rank: int, method: str, **kwargs):
        # A bucket comes as a reference into the object store, as a Ray worker host gets it.
        kwargs = {k: ray.get(v.ref) if isinstance(v, SharedArg) else v for k, v in kwargs.items()}
        return getattr(self.worker, method)(**kwargs)

    def call_all(self, method: str, **kwargs) -> list:
        return [self.call_one(0, method, **kwargs)]

    run_all_workers_single_data = call_all

    @staticmethod
    def get_all_worker_results(results: list) -> list:
        return results


class LocalHfGeneration:
    """What ``refit`` needs of an HF generation backend, over ``OneLocalWorker``."""

    shares_weight_memory = True  # as ``HfGeneration``: its parameters may live in a region
    weight_sync = None

    def __init__(self, config: GenerationConfig, worker: HfGenerationWorker) -> None:
        self.config = config
        self.worker_group = OneLocalWorker(worker)
        self.weight_version = 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_a_refit_from_a_trained_megatron_policy_gives_the_generator_its_logprobs(
    case, tmp_path_factory
):
    spec, megatron = CASES[case]
    path = save_tiny(tmp_path_factory, spec)
    model = {"path": path, "dtype": "float64"}
    data, probe = skewed_batch(), skewed_batch(seed=1)  # train on one batch, compare on another
    config = tiny_config(model=model, backend="megatron", megatron=megatron)
    gen_config = GenerationConfig.model_validate(
        {"backend": "hf", "sampling": {"max_new_tokens": 1, "stop_token_ids": []}}
    )
    worker = HfGenerationWorker(gen_config.model_dump(), model)
    # The grouped-matmul expert kernel has no float64 (the dense model has no experts).
    worker.model.config._experts_implementation = "eager"
    generation = LocalHfGeneration(gen_config, worker)
    initial = sequence_logprobs(worker.model, probe)  # from the checkpoint the policy loaded
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, config)
    try:
        policy.prepare_for_training()
        policy.train(data, NLLLoss())
        policy.prepare_for_lp_inference()
        assert policy.weight_version == 1
        expected = policy.get_logprobs(probe)["logprobs"]
        assert (expected - initial).abs().max() > 1e-1  # the step moved the weights

        def perturb() -> None:  # so that a weight the refit left out cannot pass
            with torch.no_grad():
                for p in worker.model.parameters():
                    p.add_(torch.rand_like(p) + 0.5)

        for channel in ("object_store", "shared_memory"):
            perturb()
            stats = refit(policy, generation, bucket_bytes=BUCKET_BYTES, channel=channel)
            assert stats.channel == channel and worker.get_weight_version() == 1
            if channel == "object_store":  # several buckets to each layer: the bound held
                assert stats.buckets > 2 * spec["num_hidden_layers"]
            got = sequence_logprobs(worker.model, probe)
            torch.testing.assert_close(
                got, expected, rtol=0, atol=ATOL, msg=lambda m, c=channel: f"{c}: {m}"
            )
    finally:
        if generation.weight_sync is not None:  # the policy ranks' mappings of the region
            generation.weight_sync.release()
        worker.shutdown()
        policy.shutdown()
        cluster.shutdown()
