"""Building an environment on every node that holds a worker group's bundles (needs Ray)."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rl_distributed.venvs.builder import EnvBuildError, ensure_env, rebuild_requested, resolve
from rl_distributed.venvs.registry import PythonEnv

# Rebuilds asked for with RL_REBUILD_ENVS happen once per driver, not once per worker group.
_rebuilt: set[str] = set()


@ray.remote(num_cpus=0)
def _ensure_on_this_node(env: PythonEnv, rebuild: bool, resolution: str | None) -> str:
    return ensure_env(env, rebuild=rebuild, resolution=resolution)


def python_per_node(env: PythonEnv, placement_groups: list[PlacementGroup]) -> dict[str, str]:
    """Build ``env`` once on every node holding a bundle; node id -> Python executable.

    Requirements are resolved here, in the driver, once; every node builds from that one
    resolution, so all of them get the same versions.
    """
    nodes = sorted(
        {
            node
            for pg in placement_groups
            for node in placement_group_table(pg)["bundles_to_node_id"].values()
        }
    )
    rebuild = rebuild_requested(env) and env.name not in _rebuilt
    resolution = resolve(env)
    builds = [
        _ensure_on_this_node.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        ).remote(env, rebuild, resolution)
        for node in nodes
    ]
    try:
        pythons = ray.get(builds)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, EnvBuildError):
            raise err.cause from None  # uv's own output says it all; Ray's wrapper adds noise
        raise
    if rebuild:
        _rebuilt.add(env.name)
    return dict(zip(nodes, pythons, strict=True))
