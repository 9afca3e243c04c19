"""One factory per kind of RL actor: its typed config in, a controller-side object out.

Every algorithm builds its actors here and nowhere else, so a new algorithm (or a new actor
kind: a critic, a teacher) adds a factory, not a copy of another algorithm's setup:

- ``start_cluster``: the Ray virtual cluster the worker groups are placed on;
- ``make_policy``: a trained model (``rl_models.Policy``: its workers those of the backend
  ``policy.backend`` names). The reference policy of the KL penalty and DPO is a frozen copy held by
  the same workers (``policy.reference_policy``), so it has no actor of its own;
- ``make_generator``: a sampler, the controller of the backend ``generation.backend`` names
  (``hf``, ``vllm``, or any registered one: ``rl_models.backends``);
- ``make_critic``: a value model trained beside the policy (PPO): a ``Policy`` whose model is
  ``model.kind: value``, with its own optimiser, micro-batching and checkpoint;
- ``make_teacher``: a frozen model that scores the policy's samples (distillation): a
  ``Policy`` that is never trained, asked for log-probs or top-k log-probs;
- ``start_environments`` (``rl_algorithms.environments``): reward environments, reward models
  included (``env.<task>.kind: reward_model``), one Ray actor per task.

Each object owns its worker group and has ``shutdown()``.
"""

from __future__ import annotations

from typing import Any

from rl_algorithms.config import ClusterConfig, import_path
from rl_algorithms.environments import start_environments
from rl_models.generation.config import GenerationConfig
from rl_models.policy.config import ModelConfig, PolicyConfig

__all__ = [
    "make_critic",
    "make_generator",
    "make_policy",
    "make_teacher",
    "start_cluster",
    "start_environments",
]


def start_cluster(
    config: ClusterConfig,
    name: str,
    *,
    groups_per_bundle: int = 1,
    bundles_per_node: list[int] | None = None,
) -> Any:
    """A Ray virtual cluster (starting Ray, or attaching to a running cluster) of
    ``bundles_per_node`` bundles, by default ``workers_per_node`` on each of ``num_nodes``.
    ``groups_per_bundle`` worker groups may share a bundle: 2 when the generator is colocated
    with the policy."""
    from rl_distributed.virtual_cluster import RayVirtualCluster, init_ray

    init_ray(num_cpus=config.ray_num_cpus)
    return RayVirtualCluster(
        bundles_per_node or [config.workers_per_node] * config.num_nodes,
        use_gpus=config.use_gpus,
        num_gpus_per_node=max(config.gpus_per_node, 1),
        max_colocated_worker_groups=groups_per_bundle,
        name=name,
    )


def make_policy(cluster: Any, config: PolicyConfig, name: str) -> Any:
    """A policy (or reward model: ``policy.model.kind``) training on ``cluster``."""
    from rl_models.policy.lm_policy import Policy

    return Policy(cluster, config, name_prefix=name)


def make_critic(cluster: Any, config: PolicyConfig, name: str) -> Any:
    """A critic (a value model, ``model.kind: value``) training on ``cluster``."""
    if config.model.kind != "value":
        raise ValueError(f"a critic's model must be of kind value, not {config.model.kind}")
    return make_policy(cluster, config, name)


def make_teacher(cluster: Any, config: PolicyConfig, name: str) -> Any:
    """A frozen causal LM on ``cluster`` whose log-probs the student learns from."""
    if config.model.kind != "causal_lm":
        raise ValueError(f"a teacher's model must be a causal_lm, not {config.model.kind}")
    return make_policy(cluster, config, name)


def make_generator(
    cluster: Any, config: GenerationConfig, model: ModelConfig | None, name: str
) -> Any:
    """The generator ``config.backend`` names, sampling from ``model`` on ``cluster``: the
    controller its registration names (imported only now: a backend's module may need
    dependencies of its own on the driver)."""
    from rl_distributed.venvs import registry as python_envs

    backend = config.registry.get(config.backend)
    try:
        controller = import_path(backend.implementation, "generation.backend")
    except ValueError as e:
        extras = python_envs.get(backend.env_name).extras
        raise RuntimeError(
            f"{e}; use generation.backend: hf, or install rl-models with the "
            f"{' and '.join(extras) or config.backend} extra"
        ) from e
    return controller(cluster, config, model=model, name_prefix=name)
