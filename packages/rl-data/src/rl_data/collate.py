"""From samples to batches: right-padded token tensors and the masks the losses need.

Flattened message logs give, per row:

- ``input_ids`` [B, S]: the tokens of all messages, right-padded with the pad token;
- ``input_lengths`` [B]: the real lengths (the real tokens are the first ``input_lengths``);
- ``loss_mask`` [B, S]: 1 on tokens the loss is computed on (those of the trained roles, or a
  message's own ``token_loss_mask``), 0 elsewhere.

SFT and preference batches are ``TrainBatch``es (``rl_data.batch``) with these and
``sample_mask`` [B], the sample's ``loss_multiplier`` (0 for samples over the length limit).
``S`` is the longest row, rounded up to ``pad_to_multiple``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch

from rl_data.batch import TrainBatch
from rl_data.types import DatumSpec, MessageLog, PreferenceDatumSpec
from rl_distributed.batched_data_dict import BatchedDataDict


def _check_tokenised(log: MessageLog, where: str) -> None:
    # collate is the last place to catch an untokenised sample before shapes stop making sense
    for n, message in enumerate(log):
        ids = message.get("token_ids")
        if not isinstance(ids, torch.Tensor) or ids.ndim != 1:
            raise ValueError(
                f"{where}: message {n} ({message.get('role')}) has no 1-D token_ids tensor; "
                "samples must go through a processor (ProcessedDataset) before collating"
            )


def flatten_message_logs(
    logs: Sequence[MessageLog],
    pad_token_id: int,
    pad_to_multiple: int = 1,
    loss_roles: Collection[str] = ("assistant",),
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``input_lengths`` and ``loss_mask`` for these logs."""
    if not logs:
        raise ValueError("cannot collate an empty batch")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    for b, log in enumerate(logs):
        _check_tokenised(log, f"sample {b} of the batch")
    # One concatenation of every message's ids, scattered into the padded batch at once
    # (numpy: per-row and per-message tensor ops cost more than the data they move).
    messages = [m for log in logs for m in log]
    message_lengths = np.array([m["token_ids"].shape[0] for m in messages], dtype=np.int64)
    per_row = np.array([len(log) for log in logs], dtype=np.int64)
    row_of_message = np.repeat(np.arange(len(logs)), per_row)
    lengths_np = np.bincount(row_of_message, weights=message_lengths, minlength=len(logs))
    lengths_np = lengths_np.astype(np.int64)
    width = max(int(lengths_np.max()), 1)
    width = -(-width // pad_to_multiple) * pad_to_multiple
    rows = np.repeat(np.arange(len(logs)), lengths_np)
    row_starts = np.cumsum(lengths_np) - lengths_np
    columns = np.arange(rows.shape[0]) - np.repeat(row_starts, lengths_np)
    input_ids = np.full((len(logs), width), pad_token_id, dtype=np.int64)
    loss_mask = np.zeros((len(logs), width), dtype=np.int64)
    if rows.shape[0]:
        input_ids[rows, columns] = np.concatenate([m["token_ids"].numpy() for m in messages])
        if any("token_loss_mask" in m for m in messages):
            loss = np.concatenate(
                [
                    m["token_loss_mask"].numpy()
                    if "token_loss_mask" in m
                    else np.full(n, int(m["role"] in loss_roles))
                    for m, n in zip(messages, message_lengths, strict=True)
                ]
            )
        else:
            per_message = np.array([int(m["role"] in loss_roles) for m in messages])
            loss = np.repeat(per_message, message_lengths)
        loss_mask[rows, columns] = loss
    lengths = torch.from_numpy(lengths_np)
    input_ids, loss_mask = torch.from_numpy(input_ids), torch.from_numpy(loss_mask)
    return {"input_ids": input_ids, "input_lengths": lengths, "loss_mask": loss_mask}


def sft_collate(
    batch: Sequence[DatumSpec], pad_token_id: int, pad_to_multiple: int = 1
) -> TrainBatch:
    """SFT batches: loss on assistant tokens; ``idx`` says which dataset rows they are."""
    flat = flatten_message_logs([d["message_log"] for d in batch], pad_token_id, pad_to_multiple)
    return TrainBatch(
        **flat,
        sample_mask=torch.tensor([d["loss_multiplier"] for d in batch], dtype=torch.float32),
        idx=torch.tensor([d["idx"] for d in batch], dtype=torch.long),
    )


def preference_collate(
    batch: Sequence[PreferenceDatumSpec], pad_token_id: int, pad_to_multiple: int = 1
) -> TrainBatch:
    """Preference batches of 2B rows: chosen and rejected interleaved (row 2i is pair i's
    chosen, row 2i+1 its rejected), so one forward pass scores both and pairs stay adjacent
    when the batch is split into micro-batches of even size."""
    logs = [log for d in batch for log in (d["message_log_chosen"], d["message_log_rejected"])]
    flat = flatten_message_logs(logs, pad_token_id, pad_to_multiple)
    twice = [d for d in batch for _ in range(2)]
    return TrainBatch(
        **flat,
        sample_mask=torch.tensor([d["loss_multiplier"] for d in twice], dtype=torch.float32),
        idx=torch.tensor([d["idx"] for d in twice], dtype=torch.long),
    )


def rl_collate(
    batch: Sequence[DatumSpec], pad_token_id: int, pad_to_multiple: int = 1
) -> BatchedDataDict[Any]:
    """RL prompt batches: the message logs (rollouts append to them), what the environments
    need, and the prompts flattened for the generator."""
    logs = [d["message_log"] for d in batch]
    flat = flatten_message_logs(logs, pad_token_id, pad_to_multiple, loss_roles=())
    return BatchedDataDict(
        message_log=logs,
        input_ids=flat["input_ids"],
        input_lengths=flat["input_lengths"],
        length=torch.tensor([d["length"] for d in batch], dtype=torch.long),
        loss_multiplier=torch.tensor([d["loss_multiplier"] for d in batch], dtype=torch.float32),
        extra_env_info=[d["extra_env_info"] for d in batch],
        task_name=[d.get("task_name") for d in batch],
        idx=torch.tensor([d["idx"] for d in batch], dtype=torch.long),
    )


COLLATE_FNS = {"sft": sft_collate, "preference": preference_collate, "rl": rl_collate}
