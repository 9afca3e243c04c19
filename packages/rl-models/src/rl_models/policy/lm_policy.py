"""The driver-side policy: a group of DTensor workers, one per data-parallel rank."""

from __future__ import annotations

from typing import Any

import numpy as np

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.named_sharding import NamedSharding
from rl_distributed.virtual_cluster import RayVirtualCluster
from rl_distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
from rl_models.interfaces import LossFunction, PolicyInterface
from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import packing_args

WORKER_CLASS = "rl_models.policy.dtensor_worker.DTensorPolicyWorker"


class Policy(PolicyInterface):
    """Shards each batch over the workers by global batch and gathers results in row order."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: PolicyConfig | dict[str, Any],
        name_prefix: str = "policy",
    ) -> None:
        self.config = PolicyConfig.model_validate(config)
        world = cluster.world_size()
        self.worker_group = RayWorkerGroup(
            cluster,
            RayWorkerBuilder(WORKER_CLASS, self.config.model_dump()),
            name_prefix=name_prefix,
            sharding_annotations=NamedSharding(np.arange(world), ["data_parallel"]),
        )
        self.dp_size = self.worker_group.dp_size

    def _shard(
        self, data: BatchedDataDict, batch_size: int | None
    ) -> tuple[list[BatchedDataDict], list[int] | None]:
        """Per-rank shards; with packing, also the order that restores per-row outputs.

        Packing is planned here, over all ranks at once, so that every rank gets the same number
        of micro-batches per global batch (FSDP needs the ranks' forward passes to pair up).
        """
        if self.config.sequence_packing.enabled:
            return data.shard_by_batch_size(
                self.dp_size, batch_size=batch_size, sequence_packing_args=packing_args(self.config)
            )
        return data.shard_by_batch_size(self.dp_size, batch_size=batch_size), None

    def _run(self, method: str, shards: list[BatchedDataDict], **common: Any) -> list[Any]:
        futures = self.worker_group.run_all_workers_sharded_data(
            method, in_sharded_axes=["data_parallel"], common_kwargs=common, data=shards
        )
        return self.worker_group.get_all_worker_results(futures)

    def _per_row(self, method: str, data: BatchedDataDict) -> BatchedDataDict:
        # Shards must be equal for FSDP's paired forward passes; packing equalises by itself.
        shards, restore = self._shard(data, None)
        out = BatchedDataDict.from_batches(self._run(method, shards))
        return out.reorder_data(restore) if restore is not None else out

    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        return self._per_row("get_logprobs", data)

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        return self._per_row("get_reference_policy_logprobs", data)

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        gbs = gbs or self.config.train_global_batch_size
        shards, _ = self._shard(data, gbs)
        results = self._run("train", shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)
        return results[0]  # the metrics are all-reduced: every rank returns the same

    def prepare_for_training(self) -> None:
        self._all("prepare_for_training")

    def prepare_for_lp_inference(self) -> None:
        self._all("prepare_for_lp_inference")

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", path=path)

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", path=path)

    def _all(self, method: str, **kwargs: Any) -> list[Any]:
        group = self.worker_group
        return group.get_all_worker_results(group.run_all_workers_single_data(method, **kwargs))

    def shutdown(self) -> None:
        self.worker_group.shutdown(cleanup_method="shutdown")
