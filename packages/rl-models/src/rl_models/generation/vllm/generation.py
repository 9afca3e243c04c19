"""``VllmGeneration``: the driver-side controller of a group of vLLM engines.

Data parallelism: one engine per tied group of workers; a batch is cut into contiguous shards,
one per engine, and the results are joined back in row order. Tensor parallelism (GPU only):
``tensor_parallel_size`` consecutive bundles of a node form one engine (see ``worker``).
With ``vllm.async_engine`` each engine also streams (``streaming_samplers``).

Randomness: ``generate`` gives every sampled row (one vLLM request) a seed of its own,
``SamplingParams(seed=...)``, from ``(generation.vllm.seed, weight version, sampling call
number at that version, row)`` (``rl_models.generation.seeds``): a run resumed from a
checkpoint samples what the uninterrupted run sampled, whichever engine a row lands on. Streams
(``streaming_samplers``, async GRPO) carry no seeds: they draw from each engine's own generator,
seeded ``vllm.seed + d`` at start-up, whose state no checkpoint keeps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rl_distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.named_sharding import NamedSharding
from rl_distributed.worker_groups import WorkerCallError
from rl_models.generation.config import GenerationConfig, VllmGenerationConfig
from rl_models.generation.interfaces import GenerationInterface, StaleWeightsError
from rl_models.generation.seeds import SamplingSeeds
from rl_models.generation.vllm.streaming import VllmStreamingSampler
from rl_models.model_files import materialize
from rl_models.modeling.config import ModelConfig
from rl_models.weight_transfer.buckets import PackedBucket

WORKER = "rl_models.generation.vllm.worker.VllmGenerationWorker"


def _tensor_parallel_groups(cluster: RayVirtualCluster, tp: int) -> list[tuple[int, list[int]]]:
    """Bundles of each node cut into groups of ``tp`` (an engine never spans two nodes)."""
    groups = []
    nodes = [n for n in cluster.bundle_ct_per_node_list if n > 0]
    for node_idx, count in enumerate(nodes):
        if count % tp:
            raise ValueError(
                f"vllm.tensor_parallel_size={tp} does not divide the {count} bundles of node "
                f"{node_idx}: an engine's tensor-parallel workers must share a node"
            )
        groups += [(node_idx, list(range(b, b + tp))) for b in range(0, count, tp)]
    return groups


class VllmGeneration(GenerationInterface):
    """vLLM engines in the ``vllm`` worker environment, behind ``GenerationInterface``.

    ``model`` (or ``config.model``) must name a Hugging Face directory with a tokenizer: vLLM
    loads the model from disk. ``bundle_indices_list`` places the engines on chosen bundles
    (default: every bundle of ``cluster``).
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: GenerationConfig | dict[str, Any],
        *,
        model: ModelConfig | dict[str, Any] | None = None,
        name_prefix: str = "vllm",
        bundle_indices_list: list[tuple[int, list[int]]] | None = None,
    ) -> None:
        self.config = GenerationConfig.model_validate(config)
        if not isinstance(self.config, VllmGenerationConfig):
            raise ValueError(
                f"VllmGeneration needs generation.backend 'vllm', not {self.config.backend!r}"
            )
        model = ModelConfig.model_validate(model) if model is not None else self.config.model
        if model is not None:
            model = materialize(model)  # vLLM reads safetensors, not a quantised GGUF
        if model is None or model.path is None:
            raise ValueError(
                "the vLLM backend loads the model from disk: set generation.model.path (or pass "
                "model=...) to a Hugging Face directory with a tokenizer; models built from "
                "model.hf_config must be saved with save_pretrained first"
            )
        vllm = self.config.vllm
        tp = vllm.tensor_parallel_size
        if bundle_indices_list is None:
            bundle_indices_list = _tensor_parallel_groups(cluster, tp)
        for node, bundles in bundle_indices_list:
            if len(bundles) != tp:
                raise ValueError(
                    f"bundle_indices_list entry ({node}, {bundles}) has {len(bundles)} bundles; "
                    f"each engine needs vllm.tensor_parallel_size={tp}"
                )
        dtype = vllm.dtype
        if dtype == "auto":
            dtype = "float32" if model.dtype == "float64" else model.dtype
        world = tp * len(bundle_indices_list)
        env_vars = {}
        if vllm.cpu_threads_bind is not None:
            env_vars["VLLM_CPU_OMP_THREADS_BIND"] = vllm.cpu_threads_bind
        self.worker_group = RayWorkerGroup(
            cluster,
            RayWorkerBuilder(
                WORKER, model.path, dtype, self.config.sampling.model_dump(), vllm.model_dump()
            ),
            name_prefix=name_prefix,
            bundle_indices_list=bundle_indices_list,
            sharding_annotations=NamedSharding(
                np.arange(world).reshape(-1, tp), ["data_parallel", "tensor_parallel"]
            ),
            env_vars=env_vars,
        )
        self.weight_version = 0  # the weights on disk; refit stamps the policy's version
        self.seeds = SamplingSeeds(vllm.seed)
        try:
            self._start_engines()
        except BaseException:
            self.worker_group.shutdown()
            raise

    def _start_engines(self) -> None:
        group = self.worker_group
        gpu_ids = group.call_all("gpu_ids")
        leaders, devices = [], []
        for ranks in group.tied_groups:
            for rank in ranks:
                leaders.append(rank == ranks[0])
                tied = [gpu for r in ranks for gpu in gpu_ids[r]]
                devices.append(tied if rank == ranks[0] and len(ranks) > 1 else None)
        self.startup_seconds = group.get_all_worker_results(
            group.run_all_workers_multiple_data(
                "start_engine", leader=leaders, visible_devices=devices
            )
        )
        self.leaders = [ranks[0] for ranks in group.tied_groups]
        self.pad_token_id = group.call_one(self.leaders[0], "pad_token_id")

    # -- weights ------------------------------------------------------------------------------

    def engine_weight_versions(self) -> list[int]:
        """The version each worker holds (``weight_version`` is what the controller expects)."""
        return self.worker_group.call_all("get_weight_version")

    def _check_version(self, expected: int | None) -> None:
        # The workers check too (they hold the weights); this names the error without a call.
        if expected is not None and self.weight_version != expected:
            raise StaleWeightsError(self.weight_version, expected)

    def prepare_for_weight_update(self) -> None:
        self.worker_group.call_all("prepare_for_weight_update")

    def load_weight_bucket(self, bucket: PackedBucket) -> None:
        """Load one bucket into every engine (the bucket goes to the object store once)."""
        self.worker_group.call_all("load_weight_bucket", bucket=bucket)

    def set_weight_version(self, version: int) -> None:
        self.worker_group.call_all("set_weight_version", version=version)
        self.weight_version = version

    # -- generation ---------------------------------------------------------------------------

    def _shards(self, data: BatchedDataDict) -> list[BatchedDataDict]:
        return data.shard_by_batch_size(len(self.leaders), allow_uneven_shards=True)

    def generate(
        self,
        data: BatchedDataDict,
        greedy: bool = False,
        *,
        expected_weight_version: int | None = None,
    ) -> BatchedDataDict:
        self._check_version(expected_weight_version)
        data = self.seeds.seeded(data, greedy, self.weight_version)
        group = self.worker_group
        futures = group.run_all_workers_sharded_data(
            "generate",
            in_sharded_axes=["data_parallel"],
            output_is_replicated=["tensor_parallel"],
            common_kwargs={"greedy": greedy, "expected_weight_version": expected_weight_version},
            data=self._shards(data),
        )
        try:
            results = group.get_all_worker_results(futures)
        except WorkerCallError as err:
            cause = getattr(err.__cause__, "cause", None)
            if isinstance(cause, StaleWeightsError):
                raise StaleWeightsError(cause.loaded, cause.expected) from err
            raise
        return BatchedDataDict.from_batches(
            results, pad_value_dict={"output_ids": self.pad_token_id}
        )

    def streaming_samplers(self, call_timeout: float) -> list[VllmStreamingSampler]:
        """One ``StreamingSampler`` per engine (its leader worker), in data-parallel order;
        each waits at most ``call_timeout`` s for a call. Needs ``vllm.async_engine``."""
        if not self.config.vllm.async_engine:
            raise ValueError(
                "streaming from vLLM needs generation.vllm.async_engine: true (the sync engine, "
                "vllm.LLM, samples a whole batch per call)"
            )
        group = self.worker_group
        return [
            VllmStreamingSampler(group.remote_worker(rank), call_timeout) for rank in self.leaders
        ]

    def prepare_for_generation(self) -> None:
        self.worker_group.call_all("prepare_for_generation")

    def finish_generation(self) -> None:
        self.worker_group.call_all("finish_generation")

    def shutdown(self) -> None:
        if self.worker_group.workers:
            self.worker_group.shutdown(cleanup_method="shutdown")
