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
