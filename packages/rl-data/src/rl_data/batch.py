"""The training batch: one typed record from collate to the loss, one name per concept.

Every algorithm trains on a ``TrainBatch``: SFT, DPO and reward models fill the first fields
from their data, GRPO and PPO add what rollouts and the critic give, distillation adds the
teacher's scores. Per-token fields are ``[B, S]`` (or ``[B, S, k]``), right-padded like
``input_ids`` and aligned like the policy's log-probs: ``[:, t]`` belongs to token ``t``.

Across processes a batch travels as a ``BatchedDataDict`` whose keys are exactly the field
names (``to_transport`` / ``from_transport``); a key that is not a field is refused there, so a
misspelt or renamed field fails at the boundary instead of silently dropping out of the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from rl_distributed.batched_data_dict import BatchedDataDict


@dataclass(kw_only=True)
class TrainBatch:
    """What a policy trains on. Only ``input_ids`` and ``input_lengths`` are always there."""

    input_ids: torch.Tensor
    """``[B, S]`` int64 token ids, right-padded."""
    input_lengths: torch.Tensor
    """``[B]`` the real length of each row."""
    loss_mask: torch.Tensor | None = None
    """``[B, S]`` 1 on the tokens trained on (assistant turns, sampled tokens); None: every
    real token."""
    sample_mask: torch.Tensor | None = None
    """``[B]`` a row's weight in the loss (0 drops it: over-long, filler); None: every row."""
    idx: torch.Tensor | None = None
    """``[B]`` the dataset row each sample came from."""
    advantages: torch.Tensor | None = None
    """``[B, S]`` per-token advantages (policy gradient)."""
    generation_logprobs: torch.Tensor | None = None
    """``[B, S]`` the generator's log-probs of the sampled tokens (0 elsewhere)."""
    prev_logprobs: torch.Tensor | None = None
    """``[B, S]`` log-probs of the policy the batch is trained from (pi_old)."""
    reference_logprobs: torch.Tensor | None = None
    """``[B, S]`` log-probs of the frozen reference policy."""
    values: torch.Tensor | None = None
    """``[B, S]`` the critic's values when the batch was collected (V_old, PPO)."""
    returns: torch.Tensor | None = None
    """``[B, S]`` the returns the critic is trained towards (PPO)."""
    teacher_logprobs: torch.Tensor | None = None
    """``[B, S]`` a distillation teacher's log-probs of the sampled tokens."""
    teacher_topk_logprobs: torch.Tensor | None = None
    """``[B, S, k]`` a distillation teacher's top-k log-probs at every position."""
    teacher_topk_ids: torch.Tensor | None = None
    """``[B, S, k]`` the token ids of ``teacher_topk_logprobs``."""

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def present(self) -> frozenset[str]:
        """The names of the fields this batch carries (not None)."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) is not None)

    def need(self, name: str, reader: str, shape: str = "") -> torch.Tensor:
        """Field ``name``, or a ``KeyError`` naming ``reader`` when the batch lacks it."""
        value = getattr(self, name)
        if value is None:
            what = f"{name!r} {shape}".rstrip()
            raise KeyError(f"{reader} needs {what} in the batch; it has {sorted(self.present())}")
        return value

    def replace(self, **changes: Any) -> TrainBatch:
        """A copy with these fields set (unknown names are an error, as in the constructor)."""
        return dataclasses.replace(self, **changes)

    def select(self, rows: Sequence[int] | torch.Tensor) -> TrainBatch:
        """These rows, in this order."""
        index = torch.as_tensor(rows, dtype=torch.long)
        return TrainBatch(
            **{name: getattr(self, name)[index] for name in self.present()}  # type: ignore[arg-type]
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{name: getattr(self, name).to(device) for name in self.present()})

    # -- the tokens and samples a loss counts ------------------------------------------------

    def loss_token_mask(self) -> torch.Tensor:
        """``[B, S]`` float64 mask of the tokens a token-level loss counts: ``loss_mask``
        (default every real token) times ``sample_mask``, without position 0 (which has no
        log-prob) and without padding. Workers count ``global_valid_toks`` with this same
        mask, so a loss that uses it is normalised exactly."""
        ids = self.input_ids
        positions = torch.arange(ids.shape[1], device=ids.device)
        lengths = self.input_lengths.to(ids.device)
        mask = (positions[None, :] < lengths[:, None]) & (positions[None, :] > 0)
        mask = mask.to(torch.float64)
        if self.loss_mask is not None:
            mask = mask * self.loss_mask[:, : ids.shape[1]].to(mask)
        if self.sample_mask is not None:
            mask = mask * self.sample_mask.to(mask)[:, None]
        return mask

    def sample_valid_mask(self) -> torch.Tensor:
        """``[B]`` float64 mask of the samples that count (``sample_mask``, default all)."""
        if self.sample_mask is not None:
            return self.sample_mask.to(torch.float64)
        return torch.ones(self.size, dtype=torch.float64)

    # -- transport ---------------------------------------------------------------------------

    def to_transport(self) -> BatchedDataDict[Any]:
        """The fields it carries as a ``BatchedDataDict`` (what crosses process boundaries)."""
        return BatchedDataDict({name: getattr(self, name) for name in self.present()})

    @classmethod
    def from_transport(cls, data: Mapping[str, Any]) -> TrainBatch:
        """The batch a ``BatchedDataDict`` (or any mapping of field names) carries."""
        unknown = sorted(set(data) - cls.field_names())
        if unknown:
            raise ValueError(
                f"batch keys {unknown} are not TrainBatch fields (they would be ignored by every "
                f"loss); the fields are {sorted(cls.field_names())}"
            )
        for name in ("input_ids", "input_lengths"):
            if name not in data:
                raise ValueError(f"a training batch needs {name!r}; it has {sorted(data)}")
        return cls(**{name: data[name] for name in data})


def as_transport(data: TrainBatch | BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """What a policy sends its workers: a ``TrainBatch`` converted, a ``BatchedDataDict`` as
    it is (per-row inference takes plain prompt batches too)."""
    return data.to_transport() if isinstance(data, TrainBatch) else data
