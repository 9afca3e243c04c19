"""Real policy and generation workers run in this process, behind the controllers' classes.

``Policy`` and ``HfGeneration`` drive their workers through a Ray worker group; here
``InProcessGroup`` answers the group calls they make with one worker in the test's own process
(Ray's actors are what cannot be had cheaply here; the workers, their models and their numerics
are the real ones). It logs every worker method it runs, so a test can check the calls a step
makes.

``in_process_refit`` moves the policy's weights into the generator through the same worker
methods ``rl_models.generation.refit`` calls on its object-store channel (export plan, buckets,
load, version stamp), without Ray's futures between them.
"""

from __future__ import annotations

from typing import Any

from rl_models.generation.config import GenerationConfig
from rl_models.generation.hf_generation import HfGeneration
from rl_models.generation.hf_worker import HfGenerationWorker
from rl_models.generation.refit import RefitStats
from rl_models.generation.seeds import SamplingSeeds
from rl_models.modeling.config import ModelConfig
from rl_models.policy.base_worker import batching_kind
from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.lm_policy import Policy


class InProcessGroup:
    """One worker in this process behind the worker-group calls the controllers make;
    appends ``(name, method)`` to ``log`` for every worker method it runs."""

    dp_size = 1

    def __init__(self, name: str, worker: Any, log: list) -> None:
        self.name, self.worker, self.log = name, worker, log

    def call_all(self, method: str, **kwargs):
        self.log.append((self.name, method))
        return [getattr(self.worker, method)(**kwargs)]

    def run_all_workers_sharded_data(self, method: str, *, common_kwargs=None, data, **_):
        (shard,) = data
        self.log.append((self.name, method))
        return [getattr(self.worker, method)(data=shard, **(common_kwargs or {}))]

    def run_all_workers_multiple_data(self, method: str, **per_worker):
        """Each keyword holds one value per worker: the one worker here takes the first."""
        self.log.append((self.name, method))
        return [getattr(self.worker, method)(**{k: v[0] for k, v in per_worker.items()})]

    def get_all_worker_results(self, futures):
        return futures

    def shutdown(self, **_):
        pass


def in_process_policy(config: PolicyConfig, name: str, log: list) -> Policy:
    """``Policy`` as ``actors.make_policy`` makes it, its one worker in this process."""
    policy = Policy.__new__(Policy)
    policy.config = config
    policy.worker_group = InProcessGroup(name, DTensorPolicyWorker(config), log)
    policy.dp_size, policy.on_gpu = 1, False
    policy.batching = batching_kind(config, on_gpu=False)
    policy.weight_version = 0
    return policy


def in_process_generation(
    config: GenerationConfig, model: ModelConfig, log: list, name: str = "generation"
) -> HfGeneration:
    """``HfGeneration`` as its constructor makes it, its one worker in this process."""
    generation = HfGeneration.__new__(HfGeneration)
    generation.config = config
    worker = HfGenerationWorker(config.model_dump(), model.model_dump())
    generation.worker_group = InProcessGroup(name, worker, log)
    generation.weight_version = 0
    generation.seeds = SamplingSeeds(config.seed)
    generation.pad_token_id = worker.get_pad_token_id()
    generation.weight_sync = None
    return generation


def in_process_refit(
    policy: Policy,
    generation: HfGeneration,
    *,
    dtype: str | None = None,
    bucket_bytes: int | None = None,
    deliver: bool = True,
    **_: Any,
) -> RefitStats:
    """``rl_models.generation.refit.refit`` for in-process workers: the policy's weights, cast
    to ``dtype``, bucket by bucket into the generator, then its version stamped.

    ``deliver=False`` is a refit that fails silently: the version is stamped, but no weight
    moves (the generator keeps sampling from the weights it held)."""
    src, dst = policy.worker_group, generation.worker_group
    if not deliver:
        dst.call_all("set_weight_version", version=policy.weight_version)
        generation.weight_version = policy.weight_version
        return RefitStats(version=policy.weight_version)
    bucket_bytes = bucket_bytes or generation.config.refit_bucket_bytes
    (plan,) = src.call_all("weight_export_plan", bucket_bytes=bucket_bytes, dtype=dtype)
    dst.call_all("prepare_for_weight_update")
    for step in range(plan.steps):
        (bucket,) = src.call_all("export_weight_bucket", step=step)
        dst.call_all("load_weight_bucket", bucket=bucket)
    src.call_all("finish_weight_export")
    dst.call_all("set_weight_version", version=policy.weight_version)
    generation.weight_version = policy.weight_version
    return RefitStats(version=policy.weight_version, buckets=plan.steps, bytes=plan.nbytes)
