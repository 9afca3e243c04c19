import pytest
import ray

from rl_distributed.virtual_cluster import init_ray


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test process: starting Ray costs ~8 s.

    4 logical CPUs on a 2-core machine: pools are 2 workers and mostly wait on each other.
    """
    init_ray(num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


CONTAINED: list[str] = []  # hostile programs the sandbox held, for the summary line


@pytest.fixture(scope="session")
def contained() -> list[str]:
    return CONTAINED


def pytest_terminal_summary(terminalreporter):
    if CONTAINED:
        terminalreporter.write_line(
            f"sandbox: {len(CONTAINED)} hostile programs contained ({', '.join(CONTAINED)})"
        )
