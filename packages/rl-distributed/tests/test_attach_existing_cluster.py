"""A driver with RAY_ADDRESS set attaches to that cluster instead of starting its own."""

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
    cluster = RayVirtualCluster([2], use_gpus=False)
    group = RayWorkerGroup(cluster, RayWorkerBuilder("rl_distributed.testing.EchoWorker"))
    envs = group.get_all_worker_results(group.run_all_workers_single_data("env"))
    print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                      "cpus": ray.cluster_resources()["CPU"],
                      "ranks": [e["RANK"] for e in envs]}))
    group.shutdown()
    cluster.shutdown()
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_driver_attaches_to_the_cluster_in_ray_address():
    port = free_port()
    # Token auth is Ray's own business; with it on, concurrent local clusters on one machine
    # race to rewrite ~/.ray/auth_token. This test is about finding the cluster.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    ray_cli = Path(sys.executable).parent / "ray"
    # --block keeps the head in this child process; terminating it stops only this cluster.
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=3",
            "--block",
            "--include-dashboard=false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        address = f"127.0.0.1:{port}"
        env["RAY_ADDRESS"] = address
        for _ in range(5):  # the head takes a few seconds to accept drivers
            out = subprocess.run(
                [sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=180
            )
            if out.returncode == 0:
                break
            time.sleep(1)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        head.terminate()
        head.wait(timeout=60)
    assert report["gcs"].endswith(f":{port}")
    assert report["cpus"] == 3.0
    assert report["ranks"] == ["0", "1"]
