import pytest
import ray

from rl_distributed.virtual_cluster import init_ray


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test process: starting Ray costs ~8 s.

    8 logical CPUs on a 2-core machine: the tests' workers mostly sleep or idle.
    """
    init_ray(num_cpus=8, log_to_driver=False)
    yield
    ray.shutdown()
