"""``HfGeneration``: the Hugging Face generation backend over a group of data-parallel workers.

The reference in tests and the fallback where vLLM is not installed: each worker holds a whole
``transformers`` model and samples its shard of the batch with a KV cache (``sampling.py``).

Randomness: every sampled row draws from a random stream of its own, seeded from
``(generation.seed, weight version, sampling call number at that version, row)``
(``rl_models.generation.seeds``). No random state lives only in a worker, so a run resumed from
a checkpoint samples exactly what the uninterrupted run sampled, and a row draws the same
random numbers whichever worker or batch it lands in (its tokens may still differ where batched
arithmetic rounds differently). Greedy calls draw nothing.
"""

from __future__ import annotations

from typing import Any

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.virtual_cluster import RayVirtualCluster
from rl_distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
from rl_models.generation.config import GenerationConfig, HfGenerationConfig
from rl_models.generation.interfaces import GenerationInterface, StaleWeightsError
from rl_models.generation.seeds import SamplingSeeds
from rl_models.model_files import materialize
from rl_models.modeling.config import ModelConfig
from rl_models.modeling.moe_routes import NO_ROUTE

WORKER = "rl_models.generation.hf_worker.HfGenerationWorker"


class HfGeneration(GenerationInterface):
    """One worker per bundle of ``cluster``; the batch is split evenly (the first workers take
    one row more when it does not divide)."""

    # On one CPU node ``refit`` may make the workers' parameters views of a shared weight region
    # that the policy writes into (``weight_transfer/shared_memory.py``).
    shares_weight_memory = True

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: GenerationConfig | dict[str, Any],
        model: ModelConfig | dict[str, Any] | None = None,
        name_prefix: str = "hf-generation",
    ) -> None:
        self.config = GenerationConfig.model_validate(config)
        if not isinstance(self.config, HfGenerationConfig):
            raise ValueError(
                f"HfGeneration needs generation.backend: hf, not {self.config.backend!r}"
            )
        model_config = self.config.model or (
            ModelConfig.model_validate(model) if model is not None else None
        )
        if model_config is None:
            raise ValueError("give generation.model or the policy's model config (model=...)")
        model_config = materialize(model_config)
        self.worker_group = RayWorkerGroup(
            cluster,
            RayWorkerBuilder(WORKER, self.config.model_dump(), model_config.model_dump()),
            name_prefix=name_prefix,
        )
        self.weight_version = 0  # built like the policy: its initial weights
        self.seeds = SamplingSeeds(self.config.seed)
        (self.pad_token_id, *_) = self.worker_group.call_all("get_pad_token_id")

    def generate(
        self,
        data: BatchedDataDict,
        greedy: bool = False,
        *,
        expected_weight_version: int | None = None,
    ) -> BatchedDataDict:
        if expected_weight_version is not None and expected_weight_version != self.weight_version:
            raise StaleWeightsError(self.weight_version, expected_weight_version)
        data = self.seeds.seeded(data, greedy, self.weight_version)
        group = self.worker_group
        shards = data.shard_by_batch_size(group.dp_size, allow_uneven_shards=True)
        futures = group.run_all_workers_multiple_data(
            "generate",
            data=shards,
            greedy=[greedy] * len(shards),
            expected_weight_version=[expected_weight_version] * len(shards),
        )
        return BatchedDataDict.from_batches(
            group.get_all_worker_results(futures),
            pad_value_dict={"output_ids": self.pad_token_id, "routed_experts": NO_ROUTE},
        )

    def prepare_for_generation(self) -> None:
        self.worker_group.call_all("prepare_for_generation")

    def finish_generation(self) -> None:
        self.worker_group.call_all("finish_generation")

    def shutdown(self) -> None:
        if self.weight_sync is not None:  # the policy ranks' mappings of our shared weights
            self.weight_sync.release()
        self.worker_group.shutdown(cleanup_method="shutdown")
