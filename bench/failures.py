"""Seconds from a worker's fault to the driver's error, for each way a worker fails.

Two CPU workers; one faults while its peer blocks (as if waiting for it in a collective):
SIGKILL (what the OOM killer sends), ``os._exit``, a segmentation fault in native code, and
a hang (the worker stops itself with SIGSTOP) that only the caller's deadline can end. The
faulting worker writes the time just before it faults; the driver notes when
``get_all_worker_results`` raises. Each fault runs ``--tries`` times on a fresh group.

    uv run python bench/failures.py [--tries 3] [--deadline 3]

The baseline is what a competent user writes without this library's error handling: plain
``ray.get`` on the group's calls (with the same deadline for the hang). Ray's ``ray.get`` on a
list already raises as soon as one actor dies, so for deaths the two should take about the same
time; what ours adds is an error that names the worker, its node and cause, and, for a hang,
the stuck worker's method and Python stack instead of a bare ``GetTimeoutError``. The ratio of
the worst cases (ours / plain ray.get) is printed last; target for ours: <= 10 s (a hang's time
includes its deadline and reading the worker's stack).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray

from rl_distributed import (
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerTimeoutError,
    init_ray,
)

FAULTS = ("sigkill", "exit", "segfault", "hang")


def one_try(
    cluster: RayVirtualCluster, fault: str, deadline: float, stamp: Path, plain: bool
) -> tuple[float, bool]:
    """Seconds from the fault to the driver's error for one fault on a fresh group, and whether
    the error names the worker. ``plain``: wait with ``ray.get`` (the baseline)."""
    group = RayWorkerGroup(
        cluster, RayWorkerBuilder("rl_distributed.testing.EchoWorker"), name_prefix=fault
    )
    stamp.unlink(missing_ok=True)
    try:
        if fault == "hang":
            futures = group.run_all_workers_multiple_data(
                "hang", how=[None, "stop"], stamp_file=[None, str(stamp)]
            )
        else:
            futures = group.run_all_workers_single_data(
                "die_or_block", victim_rank=1, how=fault, stamp_file=str(stamp)
            )
        timeout = deadline if fault == "hang" else 120
        try:
            if plain:
                ray.get(list(futures), timeout=timeout)
            else:
                group.get_all_worker_results(futures, timeout=timeout)
        except Exception as err:
            noticed = time.time()
            expected = WorkerTimeoutError if fault == "hang" else WorkerDiedError
            if not plain and not isinstance(err, expected):
                raise
            named = f"'{fault}-1'" in str(err)
        else:
            raise AssertionError(f"{fault}: no error raised")
        return noticed - float(stamp.read_text()), named
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
    worst = {"ours": (0.0, ""), "plain ray.get": (0.0, "")}
    try:
        for fault in FAULTS:
            for way in worst:
                tries = [
                    one_try(cluster, fault, args.deadline, stamp, plain=way != "ours")
                    for _ in range(args.tries)
                ]
                times = [t for t, _ in tries]
                extra = f" (deadline {args.deadline:g} s)" if fault == "hang" else ""
                names = "names" if all(n for _, n in tries) else "does NOT name"
                print(
                    f"{fault:9s}{extra} {way:13s}: fault -> driver error "
                    f"median {statistics.median(times):.2f} s, max {max(times):.2f} s "
                    f"over {len(times)} tries ({', '.join(f'{t:.2f}' for t in times)}); "
                    f"the error {names} the worker"
                )
                worst[way] = max(worst[way], (max(times), fault))
    finally:
        cluster.shutdown()
        scratch.cleanup()
    ours, plain = worst["ours"], worst["plain ray.get"]
    print(
        f"worst case: ours {ours[0]:.2f} s ({ours[1]}; target <= 10 s), plain ray.get "
        f"{plain[0]:.2f} s ({plain[1]}); ratio ours / plain ray.get: {ours[0] / plain[0]:.2f}x"
    )


if __name__ == "__main__":
    main()
