"""Starting a run's environments on a real Ray cluster."""

import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rl_algorithms.environments import EnvSpec, start_environments

pytestmark = pytest.mark.ray


@pytest.mark.timeout(120)
def test_an_environment_the_cluster_has_no_room_for_fails_within_seconds(ray_session):
    # The case: a reasoning-gym environment at its defaults (2 verifier workers of one
    # CPU each) on a cluster whose CPUs the policy and generation already hold. It used to sit
    # at step 0 with no message: the driver waiting on the environment, the environment on
    # verifier actors that Ray could not place.
    policy_and_generation = placement_group([{"CPU": ray.available_resources()["CPU"]}])
    ray.get(policy_and_generation.ready(), timeout=60)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError) as refused:
            actors = start_environments({"reasoning_gym": EnvSpec()})
            # Before the fix start_environments returned at once: the first step is where the
            # run hung. Bounded here, so that the old code fails instead of hanging the suite.
            ray.get(actors["reasoning_gym"].step.remote([], []), timeout=60)
        assert time.monotonic() - start < 30
        message = str(refused.value)
        assert "env.reasoning_gym" in message and "verifier pool" in message
        assert "{'CPU': 2.0} in all" in message and "{'CPU': 0.0} free" in message
    finally:
        remove_placement_group(policy_and_generation)
