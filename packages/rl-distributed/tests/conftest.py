import os

import pytest
import ray

from rl_distributed.virtual_cluster import init_ray


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray cluster for the whole test process: starting Ray costs ~8 s.

    8 logical CPUs on a 2-core machine: the tests' workers mostly sleep or idle.
    """
    # Worker environments built by the tests go to a fresh cache, set before Ray starts so
    # that the build tasks running in Ray workers see it too.
    os.environ["RL_ENV_CACHE_DIR"] = str(tmp_path_factory.mktemp("rl-envs"))
    init_ray(num_cpus=8, log_to_driver=False)
    yield
    ray.shutdown()
