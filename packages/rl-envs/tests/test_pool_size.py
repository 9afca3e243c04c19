"""How many verifier workers an environment starts: at most two when left out, fewer when
Ray has fewer CPUs free; an explicit number that cannot be placed is refused, naming its key."""

import pytest

from rl_envs.math_env import MathEnvConfig
from rl_envs.pool import MIN_CHUNK, chunk_ranges, fit_num_workers

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


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 9, 16, 31, 32, 100, 257])
@pytest.mark.parametrize("num_workers", [1, 2, 3, 8])
def test_chunks_cover_every_sample_once_in_order(n, num_workers):
    chunks = chunk_ranges(n, num_workers)
    assert [i for chunk in chunks for i in chunk] == list(range(n))
    sizes = [len(chunk) for chunk in chunks]
    # At least MIN_CHUNK a call, unless that would leave a worker without a chunk...
    if n >= MIN_CHUNK * num_workers:
        assert min(sizes[:-1], default=MIN_CHUNK) >= MIN_CHUNK
    else:
        assert len(chunks) >= min(n, num_workers)
    # ...and big maps still go out in about four chunks a worker, so a slow one delays little.
    if n >= 4 * MIN_CHUNK * num_workers:
        assert 3 * num_workers <= len(chunks) <= 4 * num_workers


def test_a_group_of_eight_goes_to_two_workers_in_two_calls_not_eight():
    assert chunk_ranges(8, 2) == [range(0, 4), range(4, 8)]
    assert chunk_ranges(2, 2) == [range(0, 1), range(1, 2)]
    assert chunk_ranges(8, 2, chunk_size=1) == [range(i, i + 1) for i in range(8)]


def test_a_chunk_size_below_one_is_refused_by_the_config():
    with pytest.raises(ValueError, match="chunk_size"):
        MathEnvConfig(chunk_size=0)


def test_code_and_tool_environments_hand_out_one_sample_a_call():
    # Slow, uneven runs balance best one at a time (two slow ones of eight in one chunk of
    # four would double the group's wall time); the cheap verifiers keep the default.
    from rl_envs.code.env import CodeEnvConfig
    from rl_envs.tools.env import ToolEnvConfig

    assert CodeEnvConfig().chunk_size == 1
    rewards = [{"function": "rl_envs.reward_functions:math_reward"}]
    assert ToolEnvConfig(tools=["calculator"], functions=rewards).chunk_size == 1
    assert MathEnvConfig().chunk_size is None
