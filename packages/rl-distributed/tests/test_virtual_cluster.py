import pytest
import ray
from ray.util import placement_group_table

from rl_distributed import virtual_cluster
from rl_distributed.virtual_cluster import ClusterError, RayVirtualCluster

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]


def test_cpu_cluster_reserves_one_group_per_node_with_bundles():
    cluster = RayVirtualCluster([0, 2, 1], use_gpus=False, name="three")
    try:
        pgs = cluster.get_placement_groups()
        assert [len(pg.bundle_specs) for pg in pgs] == [2, 1]
        assert all(b == {"CPU": 1.0} for pg in pgs for b in pg.bundle_specs)
        assert cluster.world_size() == 3
        assert cluster.node_count() == 2
        assert all(placement_group_table(pg)["state"] == "CREATED" for pg in pgs)
    finally:
        cluster.shutdown()
    assert all(placement_group_table(pg)["state"] == "REMOVED" for pg in pgs)
    with pytest.raises(ClusterError, match="shut down"):
        cluster.get_placement_groups()
    cluster.shutdown()  # a second shutdown is harmless


def test_master_ports_are_never_handed_out_twice():
    cluster = RayVirtualCluster([1], use_gpus=False)
    try:
        pairs = [cluster.get_master_address_and_port() for _ in range(25)]
    finally:
        cluster.shutdown()
    assert len(set(pairs)) == 25
    assert {addr for addr, _ in pairs} == {ray.util.get_node_ip_address()}
    # Below the range the kernel gives outgoing connections, so none can take one before its
    # rendezvous binds it (Linux's range starts at 32768 unless changed).
    # Where the range leaves no room below it, any free port is taken.
    ephemeral = virtual_cluster._ephemeral_ports()
    low, high = (20000, ephemeral.start) if ephemeral.start > 20000 else (1024, 65536)
    assert all(low <= port < high for _, port in pairs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bundle_ct_per_node_list": []}, "non-empty list"),
        ({"bundle_ct_per_node_list": [2, -1]}, "non-negative"),
        ({"bundle_ct_per_node_list": [0, 0]}, "no bundle"),
        ({"bundle_ct_per_node_list": [9], "use_gpus": True}, "num_gpus_per_node=8"),
        ({"bundle_ct_per_node_list": [1], "max_colocated_worker_groups": 0}, ">= 1"),
        ({"bundle_ct_per_node_list": [1], "placement_group_strategy": "RANDOM"}, "one of"),
    ],
)
def test_bad_requests_are_refused_before_touching_ray(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayVirtualCluster(**kwargs)


def test_a_request_the_cluster_can_never_hold_fails_at_once(monkeypatch):
    # Without the up-front check these would wait for the placement timeout, then fail.
    monkeypatch.setattr(virtual_cluster, "PLACEMENT_TIMEOUT_S", 5.0)
    total_cpus = int(ray.cluster_resources()["CPU"])
    # This Ray cluster has no GPUs at all: no node can hold a GPU bundle.
    with pytest.raises(
        ClusterError,
        match=r"'gpuless' can never be placed.*\[2\] bundles of \{'CPU': 1\.0, 'GPU': 1\.0\}"
        r".*1 alive nodes: .*0 GPU: 0 bundles",
    ):
        RayVirtualCluster([2], use_gpus=True, num_gpus_per_node=2, name="gpuless")
    half = total_cpus // 2 + 1  # two virtual nodes of this size need more CPUs than there are
    with pytest.raises(ClusterError, match=rf"'too-big' can never be placed.*\[{half}, {half}\]"):
        RayVirtualCluster([half, half], use_gpus=False, name="too-big")
    # One node cannot give two virtual nodes a node each.
    with pytest.raises(ClusterError, match=r"each on a node of its own \(STRICT_SPREAD\)"):
        RayVirtualCluster([1, 1], use_gpus=False, placement_group_strategy="STRICT_SPREAD")
    # SPREAD shares the one node instead of waiting for a second.
    shared = RayVirtualCluster([1, 1], use_gpus=False)
    try:
        assert [len(pg.bundle_specs) for pg in shared.get_placement_groups()] == [1, 1]
    finally:
        shared.shutdown()


def test_colocated_bundles_are_shared_fractionally():
    cluster = RayVirtualCluster([2], use_gpus=False, max_colocated_worker_groups=4)
    try:
        assert cluster.resources.worker_cpus == pytest.approx(0.25)
        assert cluster.resources.worker_gpus == 0
    finally:
        cluster.shutdown()


def test_output_that_is_not_a_terminal_gets_no_colour_codes_or_redrawn_bars(monkeypatch):
    import io

    from ray._private.worker import print_worker_logs

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for name in virtual_cluster.PLAIN_OUTPUT_ENV:
        monkeypatch.setenv(name, "unset")  # recorded, so the test leaves them as it found them
        monkeypatch.delenv(name)
    virtual_cluster.use_plain_output(Terminal())  # a terminal: colours and bars stay
    assert not any(name in virtual_cluster.os.environ for name in virtual_cluster.PLAIN_OUTPUT_ENV)

    monkeypatch.setenv("TQDM_DISABLE", "0")  # the user's own choice is kept
    virtual_cluster.use_plain_output(io.StringIO())  # `rl grpo > log.txt`
    env = virtual_cluster.os.environ
    assert (env["RAY_COLOR_PREFIX"], env["TQDM_DISABLE"]) == ("0", "0")
    assert env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    # What Ray then prints for a worker's line, through its own driver-side printer.
    out = io.StringIO()
    print_worker_logs({"pid": 7, "actor_name": "Policy", "lines": ["step 1"]}, out)
    assert out.getvalue() == "(Policy pid=7) step 1\n"
