import re
import sys

import numpy as np
import pytest
import ray
import torch

from rl_distributed import NamedSharding
from rl_distributed.virtual_cluster import ClusterError, RayVirtualCluster
from rl_distributed.worker_groups import (
    RayWorkerBuilder,
    RayWorkerGroup,
    WorkerCallError,
    WorkerDiedError,
    WorkerTimeoutError,
)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

ECHO = "rl_distributed.testing.EchoWorker"


@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = RayVirtualCluster([4], use_gpus=False, max_colocated_worker_groups=2)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def echo4(cluster):
    """Four workers laid out as data_parallel=2 x tensor_parallel=2."""
    sharding = NamedSharding([[0, 1], [2, 3]], ["data_parallel", "tensor_parallel"])
    group = RayWorkerGroup(
        cluster, RayWorkerBuilder(ECHO, tag="t"), name_prefix="echo", sharding_annotations=sharding
    )
    yield group
    group.shutdown()


def results(group, futures, **kwargs):
    return group.get_all_worker_results(futures, **kwargs)


def test_workers_get_the_torch_distributed_environment(echo4):
    envs = results(echo4, echo4.run_all_workers_single_data("env"))
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["NODE_RANK"] for e in envs} == {"0"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert [e["RL_WORKER_NAME"] for e in envs] == ["echo-0", "echo-1", "echo-2", "echo-3"]
    assert echo4.dp_size == 2
    assert len({m.placement["pid"] for m in echo4.worker_metadata}) == 4


def test_driver_never_imports_the_worker_class(echo4):
    assert "rl_distributed.testing" not in sys.modules


def test_virtual_nodes_get_node_ranks_and_groups_get_their_own_port(cluster):
    two_nodes = RayVirtualCluster([1, 0, 1], use_gpus=False, max_colocated_worker_groups=2)
    try:
        group = RayWorkerGroup(two_nodes, RayWorkerBuilder(ECHO))
        other = RayWorkerGroup(two_nodes, RayWorkerBuilder(ECHO), workers_per_node=[1, 0])
        envs = results(group, group.run_all_workers_single_data("env"))
        other_env = results(other, other.run_all_workers_single_data("env"))[0]
        group.shutdown()
        other.shutdown()
    finally:
        two_nodes.shutdown()
    assert [(e["NODE_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "1"),
        ("1", "0", "1"),
    ]
    assert other_env["MASTER_PORT"] != envs[0]["MASTER_PORT"]
    assert other_env["WORLD_SIZE"] == "1"


def test_single_and_multiple_data_dispatch(echo4):
    out = results(echo4, echo4.run_all_workers_single_data("echo", x=1, y="a"))
    assert out == [{"x": 1, "y": "a"}] * 4
    out = results(echo4, echo4.run_all_workers_multiple_data("echo", x=[0, 1, 2, 3]))
    assert [o["x"] for o in out] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="'x' has 3 items for 4 workers"):
        echo4.run_all_workers_multiple_data("echo", x=[0, 1, 2])


def test_large_arguments_reach_every_worker_intact(echo4):
    big = torch.arange(1 << 19, dtype=torch.float64)  # 4 MiB: shipped once via the store
    out = results(echo4, echo4.run_all_workers_single_data("echo", t=big))
    assert all(torch.equal(o["t"], big) for o in out)


def test_sharded_dispatch_shards_replicates_and_dedups_outputs(echo4):
    futures = echo4.run_all_workers_sharded_data(
        "echo",
        in_sharded_axes=["data_parallel"],
        replicate_on_axes=["tensor_parallel"],
        output_is_replicated=["tensor_parallel"],
        common_kwargs={"step": 7},
        batch=["shard-0", "shard-1"],
    )
    assert futures.worker_ranks == [0, 2]  # tensor-parallel peers' copies come back once
    assert results(echo4, futures) == [
        {"step": 7, "batch": "shard-0"},
        {"step": 7, "batch": "shard-1"},
    ]


def test_sharded_dispatch_over_two_axes_and_free_axes(echo4):
    both = echo4.run_all_workers_sharded_data(
        "echo", in_sharded_axes=["data_parallel", "tensor_parallel"], x=[["a", "b"], ["c", "d"]]
    )
    assert [o["x"] for o in results(echo4, both)] == ["a", "b", "c", "d"]
    # tensor_parallel is neither sharded nor replicated here: only its coordinate 0 gets data.
    free = echo4.run_all_workers_sharded_data("echo", in_sharded_axes=["data_parallel"], x=[1, 2])
    assert [o["x"] for o in results(echo4, free)] == [1, None, 2, None]


def test_sharded_dispatch_rejects_bad_shapes_and_axes(echo4):
    with pytest.raises(ValueError, match="unknown axis 'pipeline'"):
        echo4.run_all_workers_sharded_data("echo", in_sharded_axes=["pipeline"], x=[1])
    with pytest.raises(ValueError, match="'x' must have 2 shards at depth 0"):
        echo4.run_all_workers_sharded_data("echo", in_sharded_axes=["data_parallel"], x=[1, 2, 3])
    with pytest.raises(ValueError, match="both sharded and replicated"):
        echo4.run_all_workers_sharded_data(
            "echo", in_sharded_axes=["data_parallel"], replicate_on_axes=["data_parallel"], x=[1, 2]
        )


def test_worker_exceptions_name_the_worker_and_method(echo4):
    with pytest.raises(WorkerCallError, match=r"'echo-\d'.*'fail'.*boom"):
        results(echo4, echo4.run_all_workers_single_data("fail", message="boom"))
    with pytest.raises(WorkerCallError, match="has no method 'nope'"):
        results(echo4, echo4.run_all_workers_single_data("nope"))


def test_slow_workers_time_out_instead_of_hanging(echo4):
    futures = echo4.run_all_workers_multiple_data("sleep", seconds=[0, 0, 0, 8])
    with pytest.raises(WorkerTimeoutError, match=r"1 of 4 workers.*'echo-3'"):
        results(echo4, futures, timeout=2)
    assert results(echo4, futures) == [0, 0, 0, 8]


@pytest.mark.parametrize("how", ["exit", "sigkill", "segfault"])
def test_a_dying_worker_is_reported_while_its_peers_block(cluster, how):
    group = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), workers_per_node=2, name_prefix="dy")
    try:
        futures = group.run_all_workers_single_data("die_or_block", victim_rank=1, how=how)
        # The peer sleeps for an hour: only fail-fast detection can end this call.
        with pytest.raises(
            WorkerDiedError, match=r"worker 'dy-1' \(rank 1 .*pid \d+\) died"
        ) as err:
            results(group, futures, timeout=120)
        if how == "segfault":  # the worker's own log explains the crash
            assert "Segmentation fault" in str(err.value)
        # Later calls fail at once too, even with the peer still busy.
        with pytest.raises(WorkerDiedError, match="'dy-1'"):
            results(group, group.run_all_workers_single_data("ping"), timeout=120)
    finally:
        assert group.shutdown(timeout=5) is True


def test_a_worker_that_cannot_start_is_reported(cluster):
    with pytest.raises(WorkerDiedError, match=r"(?s)worker .Missing-\d. .*no class .Missing."):
        RayWorkerGroup(cluster, RayWorkerBuilder("rl_distributed.testing.Missing"))
    with pytest.raises(ValueError, match="class path"):
        RayWorkerBuilder("NoModule")


def test_tied_groups_from_bundle_indices(cluster):
    group = RayWorkerGroup(
        cluster, RayWorkerBuilder(ECHO), bundle_indices_list=[(0, [0, 1]), (0, [3])]
    )
    try:
        assert group.tied_groups == [[0, 1], [2]]
        assert [m.bundle_index for m in group.worker_metadata] == [0, 1, 3]
        envs = results(group, group.run_all_workers_single_data("env"))
        assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    finally:
        group.shutdown()
    with pytest.raises(ValueError, match="listed twice"):
        RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), bundle_indices_list=[(0, [1]), (0, [1])])
    with pytest.raises(ValueError, match="no bundle 4"):
        RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), bundle_indices_list=[(0, [4])])


def test_shutdown_runs_cleanup_with_a_timeout(cluster):
    quick = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO, tag="q"), workers_per_node=2)
    workers = list(quick.workers)
    assert quick.shutdown(cleanup_method="cleanup") is True
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[0].execute.remote("ping"), timeout=30)

    slow = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), workers_per_node=1)
    assert slow.shutdown(cleanup_method="slow_cleanup", timeout=1) is False


def test_data_parallel_training_with_gloo_matches_full_batch_gradient_descent(cluster):
    """Two workers train with DDP over gloo; full-batch GD in float64 is the reference."""
    dim, lr, steps = 5, 0.1, 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, dim, generator=gen, dtype=torch.float64)
    y = x @ torch.arange(1.0, dim + 1, dtype=torch.float64) + 0.3

    group = RayWorkerGroup(
        cluster,
        RayWorkerBuilder("rl_distributed.testing.DataParallelRegressor", dim=dim, lr=lr, seed=3),
        workers_per_node=2,
    )
    try:
        assert results(group, group.run_all_workers_single_data("process_group")) == [
            {"rank": 0, "world_size": 2},
            {"rank": 1, "world_size": 2},
        ]
        losses = []
        for _ in range(steps):
            shards = group.run_all_workers_sharded_data(
                "train_step", in_sharded_axes=["data_parallel"], x=x.chunk(2), y=y.chunk(2)
            )
            losses.append(results(group, shards))
        weights = results(group, group.run_all_workers_single_data("weights"))
    finally:
        group.shutdown(cleanup_method="close")

    torch.manual_seed(3)
    reference = torch.nn.Linear(dim, 1, dtype=torch.float64)
    w, b = reference.weight.detach().clone(), reference.bias.detach().clone()
    ref_losses = []
    for _ in range(steps):
        w.requires_grad_(True)
        b.requires_grad_(True)
        loss = ((x @ w.T + b).squeeze(-1) - y).pow(2).mean()
        gw, gb = torch.autograd.grad(loss, (w, b))
        ref_losses.append(loss.item())
        w, b = (w - lr * gw).detach(), (b - lr * gb).detach()

    for rank_weights in weights:
        torch.testing.assert_close(rank_weights["weight"], w, rtol=0, atol=1e-12)
        torch.testing.assert_close(rank_weights["bias"], b, rtol=0, atol=1e-12)
    # Each rank's loss is over its half; their mean is the full-batch loss.
    np.testing.assert_allclose([np.mean(step) for step in losses], ref_losses, rtol=1e-12)


def test_colocated_groups_run_side_by_side_on_the_same_bundles():
    shared = RayVirtualCluster([2], use_gpus=False, max_colocated_worker_groups=2)
    first = RayWorkerGroup(shared, RayWorkerBuilder(ECHO, tag="a"))
    second = RayWorkerGroup(shared, RayWorkerBuilder(ECHO, tag="b"))
    try:
        a = first.run_all_workers_single_data("cleanup")
        b = second.run_all_workers_single_data("cleanup")
        assert results(first, a) == ["a", "a"]
        assert results(second, b) == ["b", "b"]
        assert [m.bundle_index for m in second.worker_metadata] == [0, 1]
        with pytest.raises(ClusterError, match="bundle 0 of placement group 0 is full"):
            RayWorkerGroup(shared, RayWorkerBuilder(ECHO))
    finally:
        first.shutdown()
        second.shutdown()
        shared.shutdown()


def test_each_result_is_fetched_once_while_the_slowest_worker_finishes(echo4):
    """Waiting polls for failures; it must not deserialise the finished results every time."""
    imported_before = "rl_distributed.testing" in sys.modules
    from rl_distributed.testing import CountedPayload

    try:
        CountedPayload.loads = 0
        futures = echo4.run_all_workers_multiple_data(
            "delayed_echo",
            seconds=[0, 0, 0, 3.5],
            payload=[CountedPayload(i) for i in range(4)],
        )
        out = results(echo4, futures)
        assert [o["payload"].value for o in out] == [0, 1, 2, 3]
        assert CountedPayload.loads == 4  # one per result, however many polls it took
    finally:
        if not imported_before:  # other tests check that the driver never imports it
            sys.modules.pop("rl_distributed.testing", None)


@pytest.mark.parametrize("how", ["stop", "spin"])
def test_a_stuck_worker_is_reported_with_its_method_and_python_stack(cluster, how):
    """A worker that is alive but never answers (SIGSTOP, an endless loop): when the deadline
    passes, the error names it, the method it is running and where in Python it is."""
    # "spin" relies on the group's watchdog (call_timeout), "stop" on a per-call timeout.
    group = RayWorkerGroup(
        cluster,
        RayWorkerBuilder(ECHO),
        workers_per_node=2,
        name_prefix="hung",
        call_timeout=3 if how == "spin" else None,
    )
    try:
        group.run_all_workers_multiple_data("hang", how=[None, how])  # never awaited
        ping = group.run_all_workers_single_data("ping")
        # The healthy worker has answered before the deadline starts, however loaded the
        # machine: otherwise a slow start would report both workers, not the stuck one.
        ray.get(ping[0], timeout=120)
        with pytest.raises(WorkerTimeoutError) as err:
            results(group, ping, timeout=3 if how == "stop" else None)
    finally:
        group.shutdown(timeout=5)
    report = str(err.value)
    assert re.match(r"ping: 1 of 2 workers did not answer within 3s: worker 'hung-1'", report)
    assert "'hung-0'" not in report
    # It is stuck in the earlier call, not in the one awaited.
    assert re.search(r"worker 'hung-1' \(rank 1 .*pid \d+\) is running 'hang'", report)
    frame = {"stop": "_stopped_by_sigstop", "spin": "_spinning_forever"}[how]
    assert re.search(rf"Python stack \(py-spy\):(?s:.*){frame} \(.*testing\.py:\d+\)", report)
    state = {"stop": "stopped (SIGSTOP)", "spin": "running"}[how]
    assert f"is {state}; its Python stack" in report


def test_without_ptrace_the_stack_comes_from_faulthandler(cluster, monkeypatch):
    """Where py-spy may not read other processes, the worker writes its own stack on SIGUSR1;
    a stopped worker cannot, and the report says it is stopped."""
    from rl_distributed import hang_report

    monkeypatch.setattr(hang_report, "STACK_TOOLS", ("faulthandler",))
    group = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), workers_per_node=2, name_prefix="fh")
    try:
        futures = group.run_all_workers_multiple_data("hang", how=["spin", "stop"])
        with pytest.raises(WorkerTimeoutError) as err:
            results(group, futures, timeout=3)
    finally:
        group.shutdown(timeout=5)
    report = str(err.value)
    assert re.search(r"2 of 2 workers .*'fh-0'.*'fh-1'", report)
    assert re.search(
        r"(?s)'fh-0'.*is running 'hang'.*Python stack \(faulthandler\):"
        r".*testing\.py\", line \d+ in _spinning_forever",
        report,
    )
    assert re.search(
        r"'fh-1'.*is running 'hang': process \d+ is stopped \(SIGSTOP\); no Python stack: "
        r"a stopped process cannot run its faulthandler",
        report,
    )


def test_a_slow_worker_past_the_deadline_can_still_be_waited_for(cluster):
    """The deadline cannot tell slow from stuck; the error hands back the calls still running
    so a caller who reads the report and sees a healthy worker can keep waiting."""
    group = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), workers_per_node=2, name_prefix="slow")
    try:
        futures = group.run_all_workers_multiple_data("sleep", seconds=[0, 4])
        with pytest.raises(WorkerTimeoutError) as err:
            results(group, futures, timeout=1)
        assert err.value.ranks == [1]
        assert err.value.pending.method == "sleep"
        assert results(group, err.value.pending) == [4]
    finally:
        group.shutdown(timeout=5)


@pytest.mark.parametrize(
    "placement, message",
    [
        ({"workers_per_node": 0}, r"'empty' places no worker: workers_per_node=0"),
        ({"bundle_indices_list": [(0, [])]}, r"entry for node 0 lists no bundle"),
    ],
)
def test_a_group_without_workers_is_refused_with_a_reason(cluster, placement, message):
    with pytest.raises(ValueError, match=message):
        RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), name_prefix="empty", **placement)
    # Nothing was claimed: a full-size group still fits next to the module's other groups.
    assert all(len(owners) < 2 for owners in cluster._bundle_owners.values())


def test_results_the_caller_let_go_of_are_not_kept_alive_by_the_group(cluster):
    """The group remembers calls to say what a stuck worker runs; it must not pin finished
    results in the object store (256 big batches per worker would fill it)."""
    import gc

    group = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), workers_per_node=1, name_prefix="gc")
    try:
        futures = group.run_all_workers_single_data("echo", blob=b"x" * 200_000)
        assert len(results(group, futures)[0]["blob"]) == 200_000
        ids = {ref.hex().encode() for ref in futures}
        del futures
        gc.collect()
        counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts()
        assert ids and not ids & set(counts)
    finally:
        group.shutdown(timeout=5)


def test_a_dead_worker_whose_output_is_dropped_is_still_reported(cluster):
    """Replicated outputs come back once, but a tensor-parallel peer that dies must still be
    reported at once, not waited for behind its partners blocked in the collective."""
    sharding = NamedSharding([[0, 1], [2, 3]], ["data_parallel", "tensor_parallel"])
    group = RayWorkerGroup(
        cluster, RayWorkerBuilder(ECHO), name_prefix="tp", sharding_annotations=sharding
    )
    try:
        futures = group.run_all_workers_sharded_data(
            "die_or_block",
            output_is_replicated=["tensor_parallel"],
            common_kwargs={"victim_rank": 1, "how": "exit"},
        )
        assert futures.worker_ranks == [0, 2]  # rank 1's output would be dropped
        with pytest.raises(WorkerDiedError, match=r"worker 'tp-1' \(rank 1 .*'die_or_block'"):
            results(group, futures, timeout=60)
    finally:
        group.shutdown(timeout=5)


def test_replicated_outputs_still_come_back_once(echo4):
    futures = echo4.run_all_workers_sharded_data("env", output_is_replicated=["tensor_parallel"])
    assert [e["RANK"] for e in results(echo4, futures)] == ["0", "2"]


def test_cpu_workers_share_the_cores_of_their_node_as_threads(monkeypatch):
    """Ray alone would give the worker of a one-CPU bundle one thread; it gets the node's
    cores (shared by the group's workers there: colocated groups take turns). The driver's
    own OMP_NUM_THREADS wins."""
    import os

    cores = len(os.sched_getaffinity(0))
    one = RayVirtualCluster([1], use_gpus=False, max_colocated_worker_groups=2, name="threads")
    two = RayVirtualCluster([2], use_gpus=False, name="threads-2")
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for cluster, expected in ((one, cores), (two, max(1, cores // 2))):
            group = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), name_prefix="threads")
            envs = results(group, group.run_all_workers_single_data("env"))
            group.shutdown()
            assert {e["OMP_NUM_THREADS"] for e in envs} == {str(expected)}
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        group = RayWorkerGroup(one, RayWorkerBuilder(ECHO), name_prefix="threads-set")
        envs = results(group, group.run_all_workers_single_data("env"))
        group.shutdown()
        assert {e["OMP_NUM_THREADS"] for e in envs} == {"3"}
    finally:
        one.shutdown()
        two.shutdown()


def test_call_all_and_call_one_wait_and_name_the_worker(echo4):
    assert [r["x"] for r in echo4.call_all("echo", x=7)] == [7, 7, 7, 7]
    assert echo4.call_one(2, "echo", x=5) == {"x": 5}
    with pytest.raises(WorkerCallError, match=r"'echo-1'.*'fail'.*boom"):
        echo4.call_one(1, "fail", message="boom")
    # call_one is tracked like every call: the hang report names the method the worker runs.
    with pytest.raises(WorkerTimeoutError, match=r"'echo-3'.*running 'sleep'"):
        echo4.call_one(3, "sleep", timeout=1, seconds=4)
    with pytest.raises(IndexError, match="no worker of rank 9"):
        echo4.call_one(9, "ping")


def test_run_one_starts_a_tracked_call_and_returns_at_once(echo4):
    import time

    start = time.monotonic()
    slow = echo4.run_one(0, "delayed_echo", seconds=2, x=1)
    assert time.monotonic() - start < 1.5  # not waited for
    assert slow.worker_ranks == [0] and slow.method == "delayed_echo"
    assert echo4.call_one(1, "echo", x=2) == {"x": 2}  # another worker answers meanwhile
    assert results(echo4, slow) == [{"x": 1}]
    # Tracked: a hang report names the method worker 3 runs.
    stuck = echo4.run_one(3, "sleep", seconds=4)
    with pytest.raises(WorkerTimeoutError, match=r"'echo-3'.*running 'sleep'"):
        results(echo4, stuck, timeout=1)
    results(echo4, stuck)  # let it finish before the next test uses the worker
    with pytest.raises(IndexError, match="no worker of rank 4"):
        echo4.run_one(4, "ping")


@ray.remote(num_cpus=0)
def _call_from_another_process(worker, method, timeout, expected, kwargs):
    """What the trajectory collector does: call a worker from an actor, not the driver."""
    try:
        return "ok", worker.call(method, timeout=timeout, expected_errors=expected, **kwargs)
    except Exception as err:
        return type(err).__name__, str(err)


def test_a_remote_worker_is_called_from_another_process(echo4):
    worker = echo4.remote_worker(1)
    call = _call_from_another_process.remote
    assert ray.get(call(worker, "echo", 30, (), {"x": 3})) == ("ok", {"x": 3})
    # An expected error type reaches the caller as itself; any other names the worker.
    kind, text = ray.get(call(worker, "fail", 30, (ValueError,), {"message": "boom"}))
    assert (kind, text) == ("ValueError", "boom")
    kind, text = ray.get(call(worker, "fail", 30, (), {"message": "boom"}))
    assert kind == "WorkerCallError" and "'echo-1'" in text and "boom" in text
    kind, text = ray.get(call(worker, "sleep", 1, (), {"seconds": 3}))
    assert kind == "WorkerTimeoutError" and "'echo-1'" in text and "'sleep'" in text


def test_a_remote_worker_that_died_is_named(cluster):
    group = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), workers_per_node=1, name_prefix="rw")
    try:
        worker = group.remote_worker(0)
        kind, text = ray.get(
            _call_from_another_process.remote(worker, "die", 60, (), {"how": "exit"})
        )
        assert kind == "WorkerDiedError" and "'rw-0'" in text and "'die'" in text
    finally:
        group.shutdown()
