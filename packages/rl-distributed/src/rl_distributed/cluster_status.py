"""Readable tables of what a Ray cluster has and what is reserved on it."""

from __future__ import annotations

import ray
from ray.util import placement_group_table
from rich.table import Table


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def render_status() -> list[Table]:
    """Tables of nodes, object-store use and placement groups of the connected cluster."""
    nodes = Table(title="nodes")
    for column in (
        "node",
        "address",
        "state",
        "CPUs free/total",
        "GPUs free/total",
        "memory",
        "object store used/total",
    ):
        nodes.add_column(column)
    per_node = ray._private.state.available_resources_per_node()
    for node in ray.nodes():
        total = node["Resources"]
        free = per_node.get(node["NodeID"], {})
        store_total = total.get("object_store_memory", 0)
        store_used = store_total - free.get("object_store_memory", store_total)
        nodes.add_row(
            node["NodeID"][:12],
            node["NodeManagerAddress"],
            "alive" if node["Alive"] else "dead",
            f"{free.get('CPU', 0):g}/{total.get('CPU', 0):g}",
            f"{free.get('GPU', 0):g}/{total.get('GPU', 0):g}",
            _gib(total.get("memory", 0)),
            f"{_gib(store_used)}/{_gib(store_total)}",
        )

    groups = Table(title="placement groups")
    for column in ("id", "name", "state", "strategy", "bundles", "nodes"):
        groups.add_column(column)
    for pg_id, info in placement_group_table().items():
        bundles = ", ".join(
            "{" + ", ".join(f"{k}: {v:g}" for k, v in b.items()) + "}"
            for b in info["bundles"].values()
        )
        node_ids = sorted({n[:12] for n in info.get("bundles_to_node_id", {}).values()})
        groups.add_row(
            pg_id[:12],
            info.get("name") or "-",
            info["state"],
            info["strategy"],
            bundles,
            ", ".join(node_ids) or "-",
        )
    return [nodes, groups]
