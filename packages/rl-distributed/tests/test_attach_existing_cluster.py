"""Drivers attach to a Ray cluster started with `ray start` (RAY_ADDRESS), and virtual nodes
land on distinct Ray nodes. Two Ray nodes run on this one machine, as on two machines."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent(
    """
    import json, ray
    from rl_distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup
    cluster = RayVirtualCluster({bundles}, use_gpus=False, placement_group_strategy="{strategy}")
    group = RayWorkerGroup(cluster, RayWorkerBuilder("rl_distributed.testing.EchoWorker"))
    envs = group.call_all("env")
    print(json.dumps({{"gcs": ray.get_runtime_context().gcs_address,
                      "cpus": ray.cluster_resources()["CPU"],
                      "nodes": [m.placement["node_id"] for m in group.worker_metadata],
                      "node_ranks": [e["NODE_RANK"] for e in envs]}}))
    group.shutdown()
    cluster.shutdown()
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head (2 CPUs) and a second node (1 CPU) joined with `ray start --address`."""
    port = free_port()
    # Token auth is Ray's own business; with it on, concurrent local clusters on one machine
    # race to rewrite ~/.ray/auth_token. These tests are about finding and spreading.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    ray_cli = str(Path(sys.executable).parent / "ray")
    address = f"{socket.gethostbyname(socket.gethostname())}:{port}"
    common = ["--block", "--disable-usage-stats"]
    # --block keeps each node in its child process; terminating it stops only that node.
    nodes = [
        subprocess.Popen(
            [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", *common],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        wait_for_nodes(address, env, 1)
        nodes.append(
            subprocess.Popen(
                [ray_cli, "start", f"--address={address}", "--num-cpus=1", *common],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_for_nodes(address, env, 2)
        yield address, {**env, "RAY_ADDRESS": address}
    finally:
        for node in reversed(nodes):
            node.terminate()
            node.wait(timeout=60)


def wait_for_nodes(address: str, env: dict, count: int) -> None:
    probe = (
        f"import ray; ray.init(address='{address}'); print(sum(n['Alive'] for n in ray.nodes()))"
    )
    for _ in range(60):
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip() == str(count):
            return
        time.sleep(1)
    raise TimeoutError(f"the Ray cluster at {address} never had {count} nodes")


def run_driver(env: dict, bundles: list[int], strategy: str = "SPREAD") -> dict:
    code = DRIVER.format(bundles=bundles, strategy=strategy)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_driver_attaches_to_the_cluster_in_ray_address(two_node_cluster):
    address, env = two_node_cluster
    report = run_driver(env, [2])
    assert report["gcs"].endswith(address.rsplit(":", 1)[1])
    assert report["cpus"] == 3.0  # head 2 + second node 1: not a fresh local cluster
    assert len(set(report["nodes"])) == 1  # one virtual node stays on one physical node


def test_virtual_nodes_land_on_distinct_ray_nodes(two_node_cluster):
    _, env = two_node_cluster
    report = run_driver(env, [1, 1], strategy="STRICT_SPREAD")
    assert len(set(report["nodes"])) == 2
    assert report["node_ranks"] == ["0", "1"]
    # SPREAD (the default) spreads too when there are enough nodes.
    assert len(set(run_driver(env, [1, 1])["nodes"])) == 2
