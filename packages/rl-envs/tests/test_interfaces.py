import pytest
import torch

from rl_envs.interfaces import EnvironmentReturn, EnvironmentStep


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
