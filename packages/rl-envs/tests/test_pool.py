import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from rl_envs._child import HEADER
from rl_envs.pool import VerifierWorker, WorkerPool

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def sqrt_pool(ray_session):
    # math:sqrt raises ValueError on negatives and TypeError on strings.
    p = WorkerPool("math:sqrt", num_workers=2, timeout_s=5.0, chunk_size=2)
    yield p
    p.shutdown()


def test_results_come_back_in_item_order_across_workers(sqrt_pool):
    outcomes = sqrt_pool.map([(float(i * i),) for i in range(20)])
    assert [o.value for o in outcomes] == [float(i) for i in range(20)]
    assert sqrt_pool.map([]) == []


def test_a_verifier_that_raises_costs_one_sample(sqrt_pool):
    outcomes = sqrt_pool.map([(4.0,), (-1.0,), ("x",), (9.0,)])
    assert [o.status for o in outcomes] == ["ok", "error", "error", "ok"]
    assert outcomes[1].error.startswith("ValueError")
    assert outcomes[3].value == 3.0


def test_a_killed_worker_actor_costs_its_chunk_and_is_replaced(sqrt_pool):
    victim = sqrt_pool._workers[0]
    ray.kill(victim)
    # ray.kill is asynchronous: wait until the actor is really gone before sending it work.
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            ray.get(victim.__ray_ready__.remote(), timeout=30)
            time.sleep(0.1)
    statuses = [o.status for o in sqrt_pool.map([(1.0,), (4.0,), (9.0,), (16.0,)])]
    assert statuses[:2] == ["error", "error"] and statuses[2:] == ["ok", "ok"]
    assert [o.value for o in sqrt_pool.map([(1.0,), (4.0,), (9.0,)])] == [1.0, 2.0, 3.0]


def test_a_dead_worker_that_two_maps_see_die_is_replaced_once(sqrt_pool):
    # Two maps in different threads, each with a chunk on the dead worker: the second to
    # replace it must keep the first's replacement, or two workers would share its reservation
    # (the second never placed) and the first's would be left running.
    dead = sqrt_pool._workers[0]
    ray.kill(dead)
    sqrt_pool._replace(0, dead)
    replacement = sqrt_pool._workers[0]
    assert replacement is not dead
    sqrt_pool._replace(0, dead)
    assert sqrt_pool._workers[0] is replacement
    assert [o.value for o in sqrt_pool.map([(1.0,), (4.0,), (9.0,), (16.0,)])] == [1, 2, 3, 4]


def test_a_hanging_sample_times_out_and_the_rest_still_count(ray_session):
    pool = WorkerPool("time:sleep", num_workers=1, timeout_s=1.0)
    try:
        start = time.monotonic()
        outcomes = pool.map([(0.0,), (600.0,), (0.0,)])
        assert [o.status for o in outcomes] == ["ok", "timeout", "ok"]
        assert time.monotonic() - start < 30  # cut at its 1 s timeout, not sat out
    finally:
        pool.shutdown()


def test_a_verifier_that_cannot_be_imported_fails_at_setup(ray_session):
    with pytest.raises(RuntimeError, match="cannot start verifier"):
        WorkerPool("no_such_module_anywhere:score", num_workers=1)


def test_a_verifier_that_kills_its_process_costs_one_sample(ray_session):
    pool = WorkerPool("os:_exit", num_workers=1)
    try:
        assert [o.status for o in pool.map([(1,), (1,)])] == ["error", "error"]
    finally:
        pool.shutdown()


def _processes_with(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_a_worker_killed_mid_hang_leaves_no_verifier_process(ray_session):
    # "colorsys" as a preload marks this worker's verifier process on its command line.
    worker = ray.remote(VerifierWorker).remote("time:sleep", 600.0, ("time", "colorsys"))
    ray.get(worker.ready.remote())
    assert len(_processes_with("colorsys")) == 1
    worker.run.remote([(3600.0,)])  # hangs in the verifier process
    time.sleep(1.0)
    ray.kill(worker)
    deadline = time.monotonic() + 20
    while _processes_with("colorsys") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with("colorsys") == []


def test_a_garbled_or_truncated_result_frame_costs_only_its_sample(ray_session):
    # os.write(3, ...) from inside the verifier process writes straight onto its result
    # channel (the duplicate of its stdout, fd 3): a forged frame the parent must survive.
    garbled = HEADER.pack(8) + b"\x80\x05garbl"  # a header, then bytes that do not unpickle
    truncated = HEADER.pack(1000) + b"\x80\x05" * 5  # promises 1000 bytes, sends 10
    pool = WorkerPool("os:write", num_workers=1, timeout_s=2.0, chunk_size=4)
    try:
        outcomes = pool.map([(2, b"fine\n"), (3, garbled), (3, truncated), (2, b"fine\n")])
        assert [o.status for o in outcomes] == ["ok", "error", "timeout", "ok"]
        assert "bad result frame" in outcomes[1].error
        assert outcomes[3].value == 5
    finally:
        pool.shutdown()


def test_a_pool_of_no_given_size_fits_what_ray_has_free(sqrt_pool):
    # All CPUs but one held elsewhere (the trainer's, say): one worker, not two.
    from ray.util.placement_group import placement_group, remove_placement_group

    # Ray hands back the CPUs of earlier tests' killed actors and removed reservations a moment
    # later: wait until only the module's sqrt pool holds any, or a late release would free a
    # second CPU between the hold below and the pool's count.
    settled = ray.cluster_resources()["CPU"] - len(sqrt_pool._workers)  # one CPU a worker
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0.0) != settled and time.monotonic() < deadline:
        time.sleep(0.1)
    free = ray.available_resources().get("CPU", 0.0)
    assert free == settled, f"{free} CPUs free, not {settled}: a pool or actor outlived its test"
    held = placement_group([{"CPU": free - 1}]) if free > 1 else None
    if held is not None:
        ray.get(held.ready(), timeout=60)
    try:
        assert ray.available_resources()["CPU"] == 1
        pool = WorkerPool("math:sqrt", timeout_s=5.0)
        try:
            assert len(pool._workers) == 1
            assert [o.value for o in pool.map([(4.0,), (9.0,)])] == [2.0, 3.0]
        finally:
            pool.shutdown()
    finally:
        if held is not None:
            remove_placement_group(held)


# For the concurrency test: ``hold`` says it started, then returns only once ``release`` has run
# (or gives up); each returns the pid of the worker actor whose verifier process ran it.
HANDSHAKE = """
import os
import time
from pathlib import Path


def hold(started: str, released: str) -> str:
    Path(started).touch()
    deadline = time.monotonic() + 20
    while not Path(released).exists():
        if time.monotonic() > deadline:
            return "gave up"
        time.sleep(0.01)
    return str(os.getppid())


def release(released: str) -> str:
    Path(released).touch()
    return str(os.getppid())
"""


def test_concurrent_maps_spread_over_the_workers(ray_session, tmp_path):
    # One map holds a worker until a second map, started while the first is in flight, has
    # run: queued behind it on the same worker, the second would never run and the first
    # would give up.
    tools = tmp_path / "handshake.py"
    tools.write_text(HANDSHAKE)
    started, released = tmp_path / "started", tmp_path / "released"
    pool = WorkerPool(
        "rl_envs.tools.execute:run_tool", num_workers=2, timeout_s=60, num_cpus_per_worker=0
    )

    def run(function, **arguments):
        (outcome,) = pool.map([(f"{tools}:{function}", arguments, {}, 100)])
        assert outcome.status == "ok", outcome
        return outcome.value["output"]

    try:
        with ThreadPoolExecutor(1) as thread:
            held = thread.submit(run, "hold", started=str(started), released=str(released))
            deadline = time.monotonic() + 60
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            releaser = run("release", released=str(released))
            holder = held.result()
    finally:
        pool.shutdown()
    assert holder != "gave up"
    assert holder != releaser  # two workers, each its own actor process
