"""The training batch: one typed record from collate to the loss, one name per concept.

Every algorithm trains on a ``TrainBatch``: SFT, DPO and reward models fill the first fields
from their data, GRPO and PPO add what rollouts and the critic give, distillation adds the
teacher's scores. Per-token fields are ``[B, S]`` (or ``[B, S, k]``), right-padded like
``input_ids`` and aligned like the policy's log-probs: ``[:, t]`` belongs to token ``t``.

Across processes a batch travels as a ``BatchedDataDict`` whose keys are exactly the field
names (``to_transport`` / ``from_transport``); a key that is not a field is refused there, so a
misspelt or renamed field fails at the boundary instead of silently dropping out of the loss.
What a loss of one's own needs beyond these fields travels in ``extras`` (a tensor per name,
one row per sample), under ``extras.<name>`` in transport.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from rl_distributed.batched_data_dict import BatchedDataDict

EXTRAS_PREFIX = "extras."

#: What each field was called before it had one name, for the errors that meet the old name.
RENAMED = {
    "token_mask": "loss_mask",
    "reference_policy_logprobs": "reference_logprobs",
    "topk_logprobs": "teacher_topk_logprobs",
    "topk_ids": "teacher_topk_ids",
}


@dataclass(kw_only=True, eq=False)
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
    routed_experts: torch.Tensor | None = None
    """``[B, S, layers, k]`` int16: per token and MoE layer, the experts the generator's router
    chose (-1 where it recorded none: a response's last token, padding); what the policy's
    ``router_replay`` routes by."""
    prev_logprobs: torch.Tensor | None = None
    """``[B, S]`` log-probs of the policy the batch is trained from (pi_old). The loops take
    them at the loss's tokens only: 0 where ``loss_token_mask()`` is 0 (the prompt, and every
    token of a row whose ``sample_mask`` is 0)."""
    reference_logprobs: torch.Tensor | None = None
    """``[B, S]`` log-probs of the frozen reference policy, 0 where ``prev_logprobs`` are."""
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
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row tensors ``[B, ...]`` a loss of one's own reads (regression targets, per-turn
    rewards, ...), by name; none of the built-in losses reads them."""

    def __post_init__(self) -> None:
        # Every per-row tensor must have a row per sample: one of another length would be cut
        # or broadcast wrongly when the batch is split into micro-batches.
        rows = self.input_ids.shape[0]
        for name, value in self._tensors():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise ValueError(f"TrainBatch.{name} must be a tensor [B, ...], got {value!r}")
            if value.shape[0] != rows:
                raise ValueError(
                    f"TrainBatch.{name} has {value.shape[0]} rows but input_ids has {rows}"
                )

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(transport name, tensor) of everything the batch carries."""
        out = [(name, getattr(self, name)) for name in self.present()]
        out += [(EXTRAS_PREFIX + name, value) for name, value in self.extras.items()]
        return out

    def __getitem__(self, key: str) -> None:
        new = RENAMED.get(key, key)
        raise TypeError(
            f"a TrainBatch's fields are attributes: batch.{new}"
            + (f" ({key!r} is now {new!r})" if new != key else "")
        )

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The names of the tensor fields (``extras`` aside)."""
        return frozenset(f.name for f in fields(cls) if f.name != "extras")

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def present(self) -> frozenset[str]:
        """The names of the tensor fields this batch carries (not None)."""
        return frozenset(name for name in self.field_names() if getattr(self, name) is not None)

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
        return TrainBatch.from_transport({key: value[index] for key, value in self._tensors()})

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
        return BatchedDataDict(dict(self._tensors()))

    @classmethod
    def from_transport(cls, data: Mapping[str, Any]) -> TrainBatch:
        """The batch a ``BatchedDataDict`` (or any mapping of field names) carries."""
        extras = {
            k[len(EXTRAS_PREFIX) :]: v for k, v in data.items() if k.startswith(EXTRAS_PREFIX)
        }
        named = {k: v for k, v in data.items() if not k.startswith(EXTRAS_PREFIX)}
        unknown = sorted(set(named) - cls.field_names())
        if unknown:
            renamed = [f"{k!r} is now {RENAMED[k]!r}" for k in unknown if k in RENAMED]
            raise ValueError(
                f"batch keys {unknown} are not TrainBatch fields"
                + (f" ({'; '.join(renamed)})" if renamed else "")
                + f"; the fields are {sorted(cls.field_names())}, and a loss's own per-row "
                f"data goes in extras (key '{EXTRAS_PREFIX}<name>')"
            )
        for name in ("input_ids", "input_lengths"):
            if name not in named:
                raise ValueError(f"a training batch needs {name!r}; it has {sorted(data)}")
        return cls(**named, extras=extras)


def as_transport(data: TrainBatch | BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """What a policy sends its workers: a ``TrainBatch`` converted, a ``BatchedDataDict`` as
    it is (per-row inference takes plain prompt batches too)."""
    return data.to_transport() if isinstance(data, TrainBatch) else data
