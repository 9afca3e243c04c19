import time

import pytest
import ray

from rl_distributed import hang_report

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

UNREADABLE_PID = 1


@ray.remote(num_cpus=0)
def _reader_stuck_on_one_worker(pid, stderr_path, tools):
    """Stands in for a stack read that never ends (e.g. a reader wedged on a sick process)."""
    if pid == UNREADABLE_PID:
        time.sleep(3600)
    return f"stack of {pid}"


def test_one_unreadable_stack_costs_the_others_nothing(monkeypatch):
    """Every worker's stack is read on its own under one deadline: a read that never ends
    neither hides its node-mates' stacks nor keeps the report waiting past the deadline."""
    monkeypatch.setattr(hang_report, "_stack_on_its_node", _reader_stuck_on_one_worker)
    node = ray.get_runtime_context().get_node_id()
    placements = [
        {"node_id": node, "pid": UNREADABLE_PID},
        {"node_id": node, "pid": 4242},
        {"pid": 7},  # never started: no node to read it on
    ]
    # The deadline is generous: starting the reader tasks takes seconds on a loaded machine.
    stacks = hang_report.collect_stacks(placements, timeout=15)
    assert stacks == [
        "no Python stack: reading it took longer than 15s",
        "stack of 4242",
        "no Python stack: the worker never reported where it runs",
    ]
