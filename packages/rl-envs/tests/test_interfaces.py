import pytest
import torch

from rl_envs.interfaces import EnvironmentReturn, EnvironmentStep, RewardComponents


def test_a_batchs_return_splits_into_each_samples_step_in_order():
    ret = EnvironmentReturn(
        observations=[{"role": "environment", "content": "a"}, {"role": "user", "content": "b"}],
        metadata=[{"turn": 1}, None],
        next_stop_strings=[["</action>"], None],
        rewards=torch.tensor([0.5, 1.0]),
        terminateds=torch.tensor([False, True]),
        answers=["x", None],
    )
    first, second = ret.steps()
    assert first == EnvironmentStep(
        {"role": "environment", "content": "a"}, {"turn": 1}, ["</action>"], 0.5, False, "x"
    )
    assert second == EnvironmentStep({"role": "user", "content": "b"}, None, None, 1.0, True, None)
    # Plain Python numbers, not 0-d tensors: a step's reward adds up and compares as a float.
    assert type(first.reward) is float and type(second.terminated) is bool


def test_a_return_whose_fields_differ_in_length_is_refused():
    ret = EnvironmentReturn(
        observations=[{"role": "user", "content": "a"}],
        metadata=[None],
        next_stop_strings=[None],
        rewards=torch.tensor([0.0, 1.0]),
        terminateds=torch.tensor([False]),
        answers=[None],
    )
    with pytest.raises(ValueError, match=r"differ in length: .*'rewards': 2"):
        ret.steps()


def test_an_environment_return_hands_each_sample_its_components():
    rc = RewardComponents(("a", "b"), (1.0, 2.0), torch.tensor([[1.0, 0.0], [0.5, 1.0]]))
    ret = EnvironmentReturn(
        observations=[{"role": "user", "content": "x"}] * 2,
        metadata=[None, None],
        next_stop_strings=[None, None],
        rewards=rc.combined().float(),
        terminateds=torch.ones(2, dtype=torch.bool),
        answers=[None, None],
        reward_components=rc,
    )
    first, second = ret.steps()
    assert first.reward_components.values.tolist() == [1.0, 0.0]
    assert second.reward_components.names == ("a", "b") and second.reward == 2.5
    with pytest.raises(ValueError, match=r"differ in length: .*'reward_components': 1"):
        ret._replace(reward_components=rc[:1]).steps()
    with pytest.raises(ValueError, match="2 names, 1 weights"):
        RewardComponents(("a", "b"), (1.0,), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="names repeat"):
        RewardComponents(("a", "a"), (1.0, 1.0), torch.zeros(2, 2))
