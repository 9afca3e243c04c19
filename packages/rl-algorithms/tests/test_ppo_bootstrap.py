"""Which episodes PPO's GAE bootstraps, and from which state: the one the response was cut in,
never the state after the chat template's closing text."""

import torch

from rl_algorithms.ppo.loop import bootstrap_values, open_episodes
from rl_algorithms.rollouts import RolloutResult
from rl_distributed.batched_data_dict import BatchedDataDict


def test_the_bootstrap_state_is_right_after_the_last_action_token():
    # Row 0: prompt 0-2, response 3-5, closing text 6-7 (out of the loss). Row 1: the response
    # runs to the row's last token. Row 2: no action token at all.
    state = torch.tensor(
        [
            [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],
            [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 0.0, 0.0],
            [2.0, 2.1, 2.2, 0.0, 0.0, 0.0, 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    lengths = torch.tensor([8, 6, 3])
    aligned = torch.zeros_like(state)
    for row, n in enumerate(lengths.tolist()):
        aligned[row, 1:n] = state[row, : n - 1]  # V of the state that chose token t
    mask = torch.zeros_like(state)
    mask[0, 3:6] = 1
    mask[1, 4:6] = 1
    values = BatchedDataDict(values=aligned, final_values=state[torch.arange(3), lengths - 1])
    got = bootstrap_values(values, mask, lengths)
    # Row 0: the state after token 5 (state[5]), not after the closing text (state[7]).
    # Row 1: nothing follows token 5: the final value (state[5]). Row 2: the final value.
    torch.testing.assert_close(got, torch.tensor([0.5, 1.5, 2.2], dtype=torch.float64))


def test_only_cut_episodes_the_environment_did_not_end_are_bootstrapped():
    result = RolloutResult.__new__(RolloutResult)
    result.truncated = torch.tensor([True, True, False, False])
    result.terminated = torch.tensor([True, False, True, False])
    assert open_episodes(result).tolist() == [False, True, False, False]
