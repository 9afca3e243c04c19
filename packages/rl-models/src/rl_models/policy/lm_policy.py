"""The driver-side policy: a group of policy workers of the backend the config names (the
worker class its registration gives, ``rl_models.backends``).

DTensor/FSDP2: one worker per data-parallel rank. Megatron-core: ``world = pp * dp * tp``
workers laid out the way Megatron numbers its ranks (tensor-parallel fastest, then data
parallel, then pipeline stage); each data-parallel shard goes to all ``tp * pp`` ranks of its
model replica, and every rank of a replica returns the same result, which comes back once.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from rl_data.batch import TrainBatch, as_transport
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.named_sharding import NamedSharding
from rl_distributed.virtual_cluster import RayVirtualCluster
from rl_distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
from rl_models.interfaces import LossFunction, PolicyInterface, TrainResult
from rl_models.model_files import materialize
from rl_models.modeling.precision import settle_mixed_precision
from rl_models.policy.base_worker import (
    Batching,
    batching_kind,
    describe_batching,
    microbatch_args,
)
from rl_models.policy.config import PolicyConfig

logger = logging.getLogger(__name__)

MODEL_PARALLEL_AXES = ["pipeline_parallel", "context_parallel", "tensor_parallel"]


def worker_sharding(config: PolicyConfig, world: int) -> NamedSharding:
    """Workers as a ``[pipeline_parallel, data_parallel, context_parallel, tensor_parallel]``
    grid: the ranks of one data-parallel rank get the same batches."""
    pp, tp = config.model_parallel_layout
    cp = config.context_parallel_size
    if world % (tp * pp * cp):
        raise ValueError(
            f"{world} workers cannot be split into model replicas of tensor_parallel_size {tp} "
            f"x pipeline_parallel_size {pp} x context_parallel_size {cp}"
        )
    layout = np.arange(world).reshape(pp, world // (tp * pp * cp), cp, tp)
    names = ["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"]
    return NamedSharding(layout, names)


class Policy(PolicyInterface):
    """Shards each batch over the workers by global batch and gathers results in row order."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: PolicyConfig | dict[str, Any],
        name_prefix: str = "policy",
    ) -> None:
        self.config = PolicyConfig.model_validate(config)
        self.config.model = materialize(self.config.model)  # a GGUF file: converted once
        # "auto" precision is settled here, once, so that every rank computes alike.
        if self.config.mixed_precision == "auto":
            settled = settle_mixed_precision(
                "auto", cluster.use_gpus, self.config.supports_mixed_precision
            )
            self.config.mixed_precision = settled
            logger.info(
                f"{name_prefix}: mixed_precision auto -> {settled or 'none'} (computes in "
                f"{settled or self.config.model.dtype})"
            )
        backend = self.config.registry.get(self.config.backend)
        self.worker_group = RayWorkerGroup(
            cluster,
            RayWorkerBuilder(backend.implementation_class_path, self.config.model_dump()),
            name_prefix=name_prefix,
            sharding_annotations=worker_sharding(self.config, cluster.world_size()),
        )
        self.dp_size = self.worker_group.sharding_annotations.get_axis_size("data_parallel")
        self.on_gpu = cluster.use_gpus
        #: The micro-batching in use (``dynamic_batching.enabled: auto`` resolved for this
        #: hardware: dynamic on CPU, fixed on GPU), also logged here.
        self.batching: Batching = batching_kind(self.config, self.on_gpu)
        # Loud when `auto` turned dynamic batching on: micro-batches are then token budgets,
        # not train_micro_batch_size rows (the pre-`auto` default).
        chose_dynamic = (
            self.config.dynamic_batching.enabled == "auto" and self.batching == "dynamic"
        )
        (logger.warning if chose_dynamic else logger.info)(
            describe_batching(self.config, self.on_gpu)
        )
        # Counts changes of the weights (optimiser steps, checkpoint loads): a refit stamps it
        # on the generator, which refuses to sample from any other version.
        self.weight_version = 0

    def _shard(
        self,
        data: TrainBatch | BatchedDataDict,
        batch_size: int | None,
        training: bool,
        mbs: int | None = None,
    ) -> tuple[list[BatchedDataDict], list[int] | None]:
        """Per-rank shards; with packing or dynamic batching, also the order that restores
        per-row outputs.

        Such micro-batches are planned here, over all ranks at once, so that every rank gets the
        same number per global batch (FSDP needs the ranks' forward passes to pair up).
        """
        if training and not isinstance(data, TrainBatch):
            data = TrainBatch.from_transport(data)  # a key no loss reads: refused here, by name
        data = as_transport(data)  # what crosses to the workers
        width = data["input_ids"].shape[1]
        args = microbatch_args(self.config, training, self.on_gpu, width, rows=mbs)
        if args:
            return data.shard_by_batch_size(self.dp_size, batch_size=batch_size, **args)
        return data.shard_by_batch_size(self.dp_size, batch_size=batch_size), None

    def _run(self, method: str, shards: list[BatchedDataDict], **common: Any) -> list[Any]:
        futures = self.worker_group.run_all_workers_sharded_data(
            method,
            in_sharded_axes=["data_parallel"],
            replicate_on_axes=MODEL_PARALLEL_AXES,
            output_is_replicated=MODEL_PARALLEL_AXES,
            common_kwargs=common,
            data=shards,
        )
        return self.worker_group.get_all_worker_results(futures)

    def _per_row(
        self, method: str, data: TrainBatch | BatchedDataDict, **common: Any
    ) -> BatchedDataDict:
        shards, restore = self._shard(data, None, training=False)
        out = BatchedDataDict.from_batches(self._run(method, shards, **common))
        return out.reorder_data(restore) if restore is not None else out

    def get_logprobs(
        self, data: TrainBatch | BatchedDataDict, *, at_loss_tokens: bool = False
    ) -> BatchedDataDict:
        return self._per_row("get_logprobs", data, **_only_if(at_loss_tokens=at_loss_tokens))

    def get_reference_policy_logprobs(
        self, data: TrainBatch | BatchedDataDict, *, at_loss_tokens: bool = False
    ) -> BatchedDataDict:
        only = _only_if(at_loss_tokens=at_loss_tokens)
        return self._per_row("get_reference_policy_logprobs", data, **only)

    def get_scores(self, data: TrainBatch | BatchedDataDict) -> BatchedDataDict:
        """``{"scores": [B, num_labels]}`` of a sequence classifier (``model.kind``)."""
        return self._per_row("get_scores", data)

    def get_topk_logprobs(self, data: TrainBatch | BatchedDataDict, k: int) -> BatchedDataDict:
        """``{"topk_logprobs": [B, S, k], "topk_ids": [B, S, k]}``: the ``k`` most likely
        next tokens at every position and their log-probs (a distillation teacher's answer),
        computed a chunk of tokens at a time, where the backend can
        (``PolicyConfig.supports_topk_logprobs``)."""
        if not self.config.supports_topk_logprobs:
            raise ValueError(
                f"top-k log-probs: the {self.config.backend} backend cannot give them (dtensor "
                "can); such a teacher gives the sampled tokens' log-probs only (distillation "
                "loss_fn.estimator: sampled_token)"
            )
        return self._per_row("get_topk_logprobs", data, k=k)

    def get_values(self, data: TrainBatch | BatchedDataDict) -> BatchedDataDict:
        """A value model's (critic's) ``{"values": [B, S], "final_values": [B]}``: see
        ``DTensorPolicyWorker.get_values``."""
        return self._per_row("get_values", data)

    def train(
        self,
        data: TrainBatch | BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        gbs = gbs or self.config.train_global_batch_size
        shards, _ = self._shard(data, gbs, training=True, mbs=mbs)
        results = self._run("train", shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)
        result = results[0]  # the metrics are all-reduced: every rank returns the same
        self.weight_version += result.optimizer_steps
        return result

    def prepare_for_training(self) -> None:
        self.worker_group.call_all("prepare_for_training")

    def prepare_for_lp_inference(self) -> None:
        self.worker_group.call_all("prepare_for_lp_inference")

    def offload(self) -> None:
        """Weights and optimiser state of every worker to ``offload.device``, for a model that
        shares its device and waits for its turn (a colocated critic or teacher); the next
        ``prepare_for_lp_inference`` brings the weights back, ``prepare_for_training`` both."""
        self.worker_group.call_all("offload_weights")
        self.worker_group.call_all("offload_optimizer_state")

    def save_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        self.worker_group.call_all(
            "save_checkpoint", path=path, training_state_dir=training_state_dir
        )

    def load_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        self.worker_group.call_all(
            "load_checkpoint", path=path, training_state_dir=training_state_dir
        )
        self.weight_version += 1  # other weights: a generator must be refit

    def shutdown(self) -> None:
        self.worker_group.shutdown(cleanup_method="shutdown")


def _only_if(**flags: bool) -> dict[str, bool]:
    """The flags that are set: a worker of a plugged-in backend written before a flag existed
    still serves the calls that do not ask for it."""
    return {name: True for name, on in flags.items() if on}
