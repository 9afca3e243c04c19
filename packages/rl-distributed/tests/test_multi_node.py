"""Two Ray nodes on this one machine, as on two machines: drivers attach to the cluster
`ray start` made (RAY_ADDRESS), virtual nodes land on distinct Ray nodes, rendezvous and
placement go by node.

The second node gets its own loopback address (127.0.0.2), so "which node" is visible in
addresses as on two machines, and two logical GPUs, so the head is a CPU-only node beside a
GPU node (the workers never touch a GPU; Ray only counts them). One cluster serves every test
here: starting it costs half a minute or more on a busy machine.
"""

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

SECOND_NODE_IP = "127.0.0.2"

RENDEZVOUS = textwrap.dedent(
    """
    import json
    from rl_distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup
    cluster = RayVirtualCluster([1, 1], use_gpus=False, placement_group_strategy="STRICT_SPREAD")
    report = {}
    for name, kwargs in {
        "workers_per_node": {"workers_per_node": [0, 1]},
        "bundle_indices": {"bundle_indices_list": [(1, [0]), (0, [0])]},
    }.items():
        group = RayWorkerGroup(cluster, RayWorkerBuilder("rl_distributed.testing.EchoWorker"),
                               **kwargs)
        envs = group.call_all("env")
        report[name] = {"master": [e["MASTER_ADDR"] for e in envs],
                        "ips": [m.placement["node_ip"] for m in group.worker_metadata]}
        group.shutdown()
    # A real env:// rendezvous across the two nodes, rank 0 on the second one.
    group = RayWorkerGroup(
        cluster,
        RayWorkerBuilder("rl_distributed.testing.DataParallelRegressor", dim=3, lr=0.1),
        bundle_indices_list=[(1, [0]), (0, [0])],
    )
    report["gloo"] = group.call_all("process_group", timeout=120)
    group.shutdown(cleanup_method="close")
    cluster.shutdown()
    print(json.dumps(report))
    """
)

PLACEMENT = textwrap.dedent(
    """
    import json, time
    from rl_distributed import ClusterError, RayVirtualCluster
    from ray.util.placement_group import placement_group_table
    report = {}
    def nodes(cluster):
        return [sorted(set(placement_group_table(pg)["bundles_to_node_id"].values()))
                for pg in cluster.get_placement_groups()]
    # Two virtual nodes of one GPU: only the GPU node can hold them, so SPREAD shares it
    # instead of waiting for the CPU-only head.
    start = time.monotonic()
    cluster = RayVirtualCluster([1, 1], use_gpus=True, num_gpus_per_node=2)
    report["spread_nodes"] = nodes(cluster)
    report["spread_s"] = time.monotonic() - start
    cluster.shutdown()
    for name, bundles, strategy in (("strict", [1, 1], "STRICT_SPREAD"),
                                    ("too_many", [2, 1], "SPREAD")):
        start = time.monotonic()
        try:
            RayVirtualCluster(bundles, use_gpus=True, num_gpus_per_node=2,
                              placement_group_strategy=strategy, name=name)
        except ClusterError as err:
            report[name] = str(err)
        report[name + "_s"] = time.monotonic() - start
    print(json.dumps(report))
    """
)


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
def cpu_head_and_gpu_node():
    """A CPU-only head (2 CPUs) and a node with 2 CPUs and 2 (logical) GPUs at 127.0.0.2."""
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    ray_cli = str(Path(sys.executable).parent / "ray")
    address = f"{socket.gethostbyname(socket.gethostname())}:{port}"
    common = ["--block", "--disable-usage-stats"]
    # --block keeps each node in its own child process: terminating it stops that node only,
    # never the Ray clusters of anything else on this machine.
    nodes = [
        subprocess.Popen(
            [
                *(ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0"),
                *(f"--ray-client-server-port={free_port()}", *common),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        wait_for_nodes(address, env, 1)
        nodes.append(
            subprocess.Popen(
                [
                    *(ray_cli, "start", f"--address={address}", "--num-cpus=2", "--num-gpus=2"),
                    *(f"--node-ip-address={SECOND_NODE_IP}", *common),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_for_nodes(address, env, 2)
        yield {**env, "RAY_ADDRESS": address, "RL_PLACEMENT_TIMEOUT_S": "60"}
    finally:
        for node in reversed(nodes):
            node.terminate()
            node.wait(timeout=60)


def wait_for_nodes(address: str, env: dict, count: int) -> None:
    probe = (
        f"import ray; ray.init(address='{address}'); print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline, last = time.monotonic() + 120, "no probe finished"
    while (left := deadline - time.monotonic()) > 0:
        try:
            out = subprocess.run(
                [sys.executable, "-c", probe],
                env=env,
                capture_output=True,
                text=True,
                timeout=max(1.0, min(30.0, left)),
            )
        except subprocess.TimeoutExpired:
            # A driver that connects while the head is still starting can hang in ray.init
            # (seen once in CI: the probe never returned and the test hit its 300 s limit);
            # a fresh probe connects to the started head.
            last = "the last probe hung in ray.init"
            continue
        if out.returncode == 0 and out.stdout.strip() == str(count):
            return
        last = f"the last probe said {out.stdout.strip()!r}, stderr: {out.stderr[-1500:]}"
        time.sleep(1)
    raise TimeoutError(f"the Ray cluster at {address} never had {count} nodes; {last}")


def run_driver(env: dict, code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_master_addr_is_the_node_of_rank_0(cpu_head_and_gpu_node):
    report = run_driver(cpu_head_and_gpu_node, RENDEZVOUS)
    # Rank 0 runs on virtual node 1, the other rank on virtual node 0: two distinct nodes.
    ips = report["bundle_indices"]["ips"]
    assert len(set(ips)) == 2 and SECOND_NODE_IP in ips, report
    assert report["bundle_indices"]["master"] == [ips[0], ips[0]], report
    # workers_per_node=[0, 1]: the only worker is on virtual node 1 too.
    assert report["workers_per_node"]["ips"] == [ips[0]], report
    assert report["workers_per_node"]["master"] == [ips[0]], report
    assert report["gloo"] == [{"rank": 0, "world_size": 2}, {"rank": 1, "world_size": 2}]


def test_spread_counts_only_nodes_that_can_hold_the_bundles(cpu_head_and_gpu_node):
    report = run_driver(cpu_head_and_gpu_node, PLACEMENT)
    [[gpu_node], [same_node]] = report["spread_nodes"]
    assert gpu_node == same_node
    # Refused at once (the placement timeout is 60 s here), saying what was asked and what
    # the cluster has: a head that holds no GPU bundle and a node that holds two.
    assert report["strict_s"] < 30 and report["too_many_s"] < 30, report
    assert "each on a node of its own (STRICT_SPREAD)" in report["strict"]
    for message in (report["strict"], report["too_many"]):
        assert "2 alive nodes" in message
        assert "(2 CPU, 0 GPU: 0 bundles)" in message
        assert f"{SECOND_NODE_IP} (2 CPU, 2 GPU: 2 bundles)" in message
    assert "[2, 1] bundles of {'CPU': 1.0, 'GPU': 1.0}" in report["too_many"]


def attach_and_report(env: dict, bundles: list[int], strategy: str = "SPREAD") -> dict:
    return run_driver(env, DRIVER.format(bundles=bundles, strategy=strategy))


def test_driver_attaches_to_the_cluster_in_ray_address(cpu_head_and_gpu_node):
    env = cpu_head_and_gpu_node
    report = attach_and_report(env, [2])
    assert report["gcs"].endswith(env["RAY_ADDRESS"].rsplit(":", 1)[1])
    assert report["cpus"] == 4.0  # head 2 + second node 2: not a fresh local cluster
    assert len(set(report["nodes"])) == 1  # one virtual node stays on one physical node


def test_virtual_nodes_land_on_distinct_ray_nodes(cpu_head_and_gpu_node):
    env = cpu_head_and_gpu_node
    report = attach_and_report(env, [1, 1], strategy="STRICT_SPREAD")
    assert len(set(report["nodes"])) == 2
    assert report["node_ranks"] == ["0", "1"]
    # SPREAD (the default) spreads too when there are enough nodes.
    assert len(set(attach_and_report(env, [1, 1])["nodes"])) == 2
