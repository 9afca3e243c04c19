"""Conversations pickled with their tensors as numpy arrays come back as they left."""

import pickle
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from rl_data.array_pickling import ArrayPickled, reduce_with_arrays


def conversation() -> list[dict]:
    return [
        {"role": "user", "content": "12 + 15?", "token_ids": torch.arange(7)},
        {
            "role": "assistant",
            "content": "27",
            "token_ids": torch.tensor([5, 9], dtype=torch.int64),
            "token_loss_mask": torch.tensor([True, False]),
            "generation_logprobs": torch.tensor([-0.25, -1.5], dtype=torch.float32),
            "routed_experts": torch.tensor([[[1, -1]], [[0, 3]]], dtype=torch.int16),
            "tool_calls": [{"name": "add", "arguments": {"a": 12}}],
        },
    ]


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def out_of_band_round_trip(value):
    """Pickle as Ray does (protocol 5, buffers out of band), the buffers handed back
    read-only, as an object store maps them."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[memoryview(b.raw()).toreadonly() for b in buffers])


def sends_torch_tensors(value) -> bool:
    """Whether pickling ``value`` writes a tensor torch's way (its storage, slowly)."""
    return b"_rebuild_tensor" in pickle.dumps(value)


def test_logs_come_back_as_plain_logs_with_equal_tensors():
    logs = [conversation(), conversation()[:1]]
    assert sends_torch_tensors(logs) and not sends_torch_tensors(ArrayPickled(logs))
    for back in (
        pickle.loads(pickle.dumps(ArrayPickled(logs))),
        out_of_band_round_trip(ArrayPickled(logs)),
    ):
        assert type(back) is list  # the wrapper is gone
        assert_same(back, logs)


def test_restored_tensors_own_writable_memory():
    big = torch.arange(100_000, dtype=torch.int64)  # large enough to go out of band
    logs = [[{"role": "assistant", "content": "x", "token_ids": big}]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a tensor over a read-only buffer
        back = out_of_band_round_trip(ArrayPickled(logs))
    ids = back[0][0]["token_ids"]
    ids[0] = -1  # writable; and the sender's tensor is untouched
    assert int(big[0]) == 0


def test_a_slice_sends_its_own_bytes_not_its_storage():
    storage = torch.zeros(1_000_000, dtype=torch.int64)
    view = storage[10:20]
    as_arrays = pickle.dumps(ArrayPickled([view]))
    assert len(as_arrays) < 1_000  # torch's own pickling writes the whole 8 MB storage
    assert torch.equal(pickle.loads(as_arrays)[0], view)


def test_what_is_shared_is_sent_once_and_comes_back_shared():
    prompt = {"role": "user", "content": "q", "token_ids": torch.arange(2000)}
    logs = [[dict(prompt), {"role": "assistant", "content": "a", "token_ids": torch.arange(3)}]]
    logs *= 8  # a group's conversations share their prompt's token ids (and here, more)
    alone = len(pickle.dumps(ArrayPickled(logs[:1])))
    assert len(pickle.dumps(ArrayPickled(logs))) < alone + 200
    back = out_of_band_round_trip(ArrayPickled(logs))
    assert back[0] is back[7] and back[0][0]["token_ids"] is back[5][0]["token_ids"]
    assert_same(back, logs)
    looped: list = [torch.ones(2)]
    looped.append(looped)  # a structure that refers to itself stays finite
    again = pickle.loads(pickle.dumps(ArrayPickled(looped)))
    assert again[1] is again and torch.equal(again[0], torch.ones(2))


def test_an_expanded_tensor_is_not_sent_whole():
    wide = torch.arange(4).expand(100_000, 4)
    data = pickle.dumps(ArrayPickled([wide]))
    assert len(data) < 10_000  # as an array it would be 3.2 MB
    assert torch.equal(pickle.loads(data)[0], wide)


def test_what_numpy_cannot_hold_travels_as_a_tensor():
    weights = torch.ones(3, requires_grad=True)
    halves = torch.tensor([0.5, 1.5], dtype=torch.bfloat16)
    user_array = np.arange(3)
    back = pickle.loads(pickle.dumps(ArrayPickled({"w": weights, "h": halves, "a": user_array})))
    assert back["w"].requires_grad and torch.equal(back["w"].detach(), weights.detach())
    assert back["h"].dtype == torch.bfloat16 and torch.equal(back["h"], halves)
    assert isinstance(back["a"], np.ndarray)  # a user's array is not turned into a tensor


class Scores(NamedTuple):
    rewards: torch.Tensor
    answers: list[str | None]

    def __reduce__(self):
        return reduce_with_arrays(self)


@dataclass
class Result:
    logs: list
    rewards: torch.Tensor
    label: str = "x"

    def __reduce__(self):
        return reduce_with_arrays(self)


def test_records_rebuild_through_their_constructor():
    scores = Scores(torch.tensor([1.0, 0.0]), ["27", None])
    assert not sends_torch_tensors(scores)
    back = pickle.loads(pickle.dumps(scores))
    assert type(back) is Scores
    assert_same(tuple(back), tuple(scores))
    result = Result([conversation()], torch.tensor([0.5]), "y")
    assert not sends_torch_tensors(result)
    again = out_of_band_round_trip(result)
    assert type(again) is Result and again.label == "y"
    assert_same(again.logs, result.logs)
    assert_same(again.rewards, result.rewards)
