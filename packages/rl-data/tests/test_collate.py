import pytest
import torch

from rl_data.batch import TrainBatch
from rl_data.collate import flatten_message_logs, preference_collate, rl_collate, sft_collate


def msg(role, ids, **extra):
    return {"role": role, "content": "", "token_ids": torch.tensor(ids), **extra}


def datum(log, idx, mult=1.0):
    return {
        "message_log": log,
        "length": sum(len(m["token_ids"]) for m in log),
        "extra_env_info": {"i": idx},
        "loss_multiplier": mult,
        "idx": idx,
        "task_name": "t",
    }


LOGS = [
    [msg("user", [5, 6, 7]), msg("assistant", [8, 9])],
    [msg("system", [1]), msg("user", [2]), msg("assistant", [3, 4, 5, 6])],
    [msg("user", [7]), msg("assistant", [9, 9], token_loss_mask=torch.tensor([1, 0]))],
]


def test_flatten_matches_a_plain_padding_loop():
    out = flatten_message_logs(LOGS, pad_token_id=0)
    width = max(sum(len(m["token_ids"]) for m in log) for log in LOGS)
    for b, log in enumerate(LOGS):
        ids, loss = [], []
        for m in log:
            ids += m["token_ids"].tolist()
            mask = m.get("token_loss_mask")
            loss += (
                mask.tolist()
                if mask is not None
                else [int(m["role"] == "assistant")] * len(m["token_ids"])
            )
        pad = width - len(ids)
        assert out["input_ids"][b].tolist() == ids + [0] * pad
        assert out["loss_mask"][b].tolist() == loss + [0] * pad
        assert out["input_lengths"][b].item() == len(ids)


def test_pad_to_multiple_rounds_the_width_up():
    assert flatten_message_logs(LOGS, 0, pad_to_multiple=8)["input_ids"].shape == (3, 8)
    assert flatten_message_logs(LOGS, 0, pad_to_multiple=6)["input_ids"].shape == (3, 6)
    assert flatten_message_logs(LOGS[:1], 0, pad_to_multiple=5)["input_ids"].shape == (1, 5)


def test_sft_collate_gives_a_train_batch_with_sample_mask():
    batch = sft_collate([datum(LOGS[0], 3), datum(LOGS[1], 8, mult=0.0)], pad_token_id=99)
    assert isinstance(batch, TrainBatch) and batch.size == 2
    assert batch.sample_mask.tolist() == [1.0, 0.0]
    assert batch.idx.tolist() == [3, 8]
    assert batch.input_ids[0].tolist() == [5, 6, 7, 8, 9, 99]


def test_preference_collate_interleaves_chosen_and_rejected():
    def pair(c, r, i):
        return {
            "message_log_chosen": c,
            "message_log_rejected": r,
            "length_chosen": 0,
            "length_rejected": 0,
            "loss_multiplier": 1.0,
            "idx": i,
        }

    batch = preference_collate(
        [pair(LOGS[0], LOGS[1], 0), pair(LOGS[2], LOGS[0], 1)], pad_token_id=0
    )
    assert batch.size == 4
    assert batch.input_lengths.tolist() == [5, 6, 3, 5]
    assert batch.idx.tolist() == [0, 0, 1, 1]


def test_rl_collate_keeps_message_logs_and_env_info():
    batch = rl_collate([datum(LOGS[0][:1], 0), datum(LOGS[1][:2], 1)], pad_token_id=0)
    assert batch["message_log"][1] == LOGS[1][:2]
    assert batch["extra_env_info"] == [{"i": 0}, {"i": 1}]
    assert batch["input_ids"].tolist() == [[5, 6, 7], [1, 2, 0]]
    assert batch["length"].tolist() == [3, 2] and batch["task_name"] == ["t", "t"]


def test_untokenised_samples_are_refused_before_any_tensor_work():
    raw = [[{"role": "user", "content": "hi"}]]
    with pytest.raises(
        ValueError, match=r"sample 0 of the batch: message 0 \(user\) has no 1-D token_ids"
    ):
        flatten_message_logs(raw, 0)
    with pytest.raises(ValueError, match="empty batch"):
        flatten_message_logs([], 0)
