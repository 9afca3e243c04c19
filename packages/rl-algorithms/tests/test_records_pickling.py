"""The records that cross processes (an environment's return, a rollout's result, an async
group) pickle their tensors as arrays (``rl_data.array_pickling``), come back equal through
pickle and ``torch.save``, and keep ``copy.copy`` shallow."""

import copy
import io
import pickle

import torch

from rl_algorithms.grpo.replay_buffer import TrajectoryGroup
from rl_algorithms.rollouts import RolloutResult
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.interfaces import EnvironmentReturn, RewardComponents


def components() -> RewardComponents:
    return RewardComponents(("correct", "format"), (1.0, 0.5), torch.tensor([[1.0, 0.0]] * 2))


def env_return() -> EnvironmentReturn:
    return EnvironmentReturn(
        observations=[{"role": "environment", "content": "right"}] * 2,
        metadata=[{"turn": 1}, None],
        next_stop_strings=[None, ["</tool>"]],
        rewards=torch.tensor([1.0, 0.0]),
        terminateds=torch.tensor([True, False]),
        answers=["27", None],
        reward_components=components(),
        unscored=torch.tensor([False, True]),
    )


def rollout() -> RolloutResult:
    prompt = {"role": "user", "content": "12 + 15?", "token_ids": torch.arange(9)}
    logs = [
        [prompt, {"role": "assistant", "content": c, "token_ids": torch.tensor([4, i])}]
        for i, c in enumerate(["27", "28"])
    ]
    return RolloutResult(
        message_logs=logs,
        rewards=torch.tensor([1.0, 0.0]),
        truncated=torch.tensor([False, True]),
        terminated=torch.tensor([True, False]),
        turns=torch.tensor([1, 1]),
        env_metadata=[None, {"ground_truth": "27"}],
        answers=["27", "28"],
        metrics={"accuracy": 0.5},
        filler=torch.tensor([False, True]),
        task_names=["math", "math"],
        group_ids=[3, 3],
        reward_components=components(),
        end_reasons=["terminated", "max_new_tokens"],
        tool_calls=torch.tensor([0, 2]),
        timings={"episode_seconds": 1.5},
    )


def trajectory_group() -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt=BatchedDataDict(idx=[3]),
        result=rollout(),
        version_min=torch.tensor([4, 5]),
        version_max=torch.tensor([5, 5]),
        seconds=2.5,
        requeues=1,
        step_min=torch.tensor([2, 3]),
    )


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict | BatchedDataDict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(
            same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__
        )
    return a == b


def through_torch_save(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)  # as a checkpoint keeps the async buffer's groups
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_each_record_comes_back_equal_without_torchs_tensor_pickling():
    for make in (components, env_return, rollout, trajectory_group):
        record = make()
        assert b"_rebuild_tensor" not in pickle.dumps(record), make.__name__
        for back in (pickle.loads(pickle.dumps(record)), through_torch_save(record)):
            assert type(back) is type(record)
            assert (
                same(tuple(back), tuple(record))
                if isinstance(record, tuple)
                else same(back, record)
            )


def test_a_rollouts_shared_prompt_stays_shared():
    back = pickle.loads(pickle.dumps(rollout()))
    assert back.message_logs[0][0] is back.message_logs[1][0]


def test_copy_is_shallow_and_deepcopy_deep():
    for make in (components, env_return, rollout, trajectory_group):
        record = make()
        shallow, deep = copy.copy(record), copy.deepcopy(record)
        assert type(shallow) is type(record) and type(deep) is type(record)
        tensor_field = {
            "components": "values",
            "env_return": "rewards",
            "rollout": "rewards",
            "trajectory_group": "version_min",
        }[make.__name__]
        assert getattr(shallow, tensor_field) is getattr(record, tensor_field)
        assert getattr(deep, tensor_field) is not getattr(record, tensor_field)
        assert torch.equal(getattr(deep, tensor_field), getattr(record, tensor_field))
