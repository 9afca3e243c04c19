"""How many verifier workers an environment starts: at most two when left out, fewer when
Ray has fewer CPUs free; an explicit number that cannot be placed is refused, naming its key."""

import pytest

from rl_envs.math_env import MathEnvConfig
from rl_envs.pool import fit_num_workers

KEY = "env.arithmetic.config.num_workers"


@pytest.mark.parametrize(
    ("free_cpus", "cpus_per_worker", "expected"),
    [
        (8.0, 1.0, 2),  # room for more: two
        (1.0, 1.0, 1),  # a 2-core machine whose other core the trainer holds
        (1.0, 0.5, 2),
        (1.5, 1.0, 1),  # whole workers only
        (0.0, 0.0, 2),  # workers that reserve no CPU always fit
    ],
)
def test_left_out_it_fits_the_free_cpus_at_most_two(free_cpus, cpus_per_worker, expected):
    assert fit_num_workers(None, cpus_per_worker, free_cpus, KEY) == expected


def test_left_out_with_no_cpu_free_it_names_the_keys_and_what_is_free():
    message = (
        r"env\.arithmetic\.config\.num_workers: no room for even one verifier worker of 1 CPU "
        r"\(env\.arithmetic\.config\.num_cpus_per_worker\): the Ray cluster has 0\.5 CPUs free"
    )
    with pytest.raises(ValueError, match=message):
        fit_num_workers(None, 1.0, 0.5, KEY)


def test_an_explicit_number_is_kept_when_it_fits_and_refused_when_not():
    assert fit_num_workers(3, 1.0, 3.0, KEY) == 3
    message = (
        r"env\.arithmetic\.config\.num_workers is 3: 3 verifier workers of 1 CPU .* need 3 "
        r"CPUs, and the Ray cluster has 2 free .*; lower it, or leave it out"
    )
    with pytest.raises(ValueError, match=message):
        fit_num_workers(3, 1.0, 2.0, KEY)


def test_the_config_leaves_it_to_fit():
    assert MathEnvConfig().num_workers is None
    with pytest.raises(ValueError):
        MathEnvConfig(num_workers=0)
