"""Seconds from a worker's fault to the driver's error, for each way a worker fails.

Two CPU workers; one faults while its peer blocks (as if waiting for it in a collective):
SIGKILL (what the OOM killer sends), ``os._exit``, a segmentation fault in native code, and
a hang (the worker stops itself with SIGSTOP) that only the caller's deadline can end. The
faulting worker writes the time just before it faults; the driver notes when
``get_all_worker_results`` raises. Each fault runs ``--tries`` times on a fresh group.

    uv run python bench/failures.py [--tries 3] [--deadline 3]

There is no baseline to divide by: with plain ``ray.get`` on the group's calls, the blocked
peer keeps the death waiting, and a hang waits forever. The worst case is printed last; the
target is <= 10 s (a hang's time includes its deadline and reading the worker's stack).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rl_distributed import (
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerTimeoutError,
    init_ray,
)

FAULTS = ("sigkill", "exit", "segfault", "hang")


def one_try(cluster: RayVirtualCluster, fault: str, deadline: float, stamp: Path) -> float:
    """Seconds from the fault to the driver's error, for one fault on a fresh group."""
    group = RayWorkerGroup(
        cluster, RayWorkerBuilder("rl_distributed.testing.EchoWorker"), name_prefix=fault
    )
    stamp.unlink(missing_ok=True)
    try:
        if fault == "hang":
            futures = group.run_all_workers_multiple_data(
                "hang", how=[None, "stop"], stamp_file=[None, str(stamp)]
            )
            expected: type[Exception] = WorkerTimeoutError
        else:
            futures = group.run_all_workers_single_data(
                "die_or_block", victim_rank=1, how=fault, stamp_file=str(stamp)
            )
            expected = WorkerDiedError
        try:
            group.get_all_worker_results(futures, timeout=deadline if fault == "hang" else 120)
        except expected as err:
            noticed = time.time()
            assert f"'{fault}-1'" in str(err), f"the error does not name the worker: {err}"
        else:
            raise AssertionError(f"{fault}: no error raised")
        return noticed - float(stamp.read_text())
    finally:
        group.shutdown(timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=3.0, help="hang deadline, seconds")
    args = parser.parse_args()

    init_ray(num_cpus=4, log_to_driver=False)
    cluster = RayVirtualCluster([2], use_gpus=False)
    scratch = tempfile.TemporaryDirectory(prefix="rl-bench-failures-")
    stamp = Path(scratch.name) / "fault-time"
    worst = (0.0, "")
    try:
        for fault in FAULTS:
            times = [one_try(cluster, fault, args.deadline, stamp) for _ in range(args.tries)]
            extra = f" (deadline {args.deadline:g} s)" if fault == "hang" else ""
            print(
                f"{fault:9s}{extra}: fault -> driver error "
                f"median {statistics.median(times):.2f} s, max {max(times):.2f} s "
                f"over {len(times)} tries: {', '.join(f'{t:.2f}' for t in times)}"
            )
            worst = max(worst, (max(times), fault))
    finally:
        cluster.shutdown()
        scratch.cleanup()
    print(f"worst case: {worst[0]:.2f} s ({worst[1]}; target <= 10 s)")


if __name__ == "__main__":
    main()
