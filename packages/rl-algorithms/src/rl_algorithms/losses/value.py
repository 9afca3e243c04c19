"""The critic's loss in PPO: a (clipped) squared error to the GAE returns.

Data (``[B, S]`` tensors aligned like the log-probs, see ``rl_models.interfaces``):

- ``input_ids``, ``input_lengths``, ``loss_mask`` (1 on generated tokens), ``sample_mask``:
  they make the loss tokens (``loss_token_mask``), the action tokens of ``ppo.gae``;
- ``values``: the critic's predictions when the batch was collected (V_old, before this
  training step); ``returns``: the GAE returns (``ppo.gae.gae``).

The first argument is the critic's current prediction ``V`` ``[B, S]``, aligned the same way
(``V[:, t]`` estimates the state that chose token ``t``). Per token, with ``R`` the return and
``c = value_clip`` (the form of PPO2 / OpenAI baselines)::

    loss = 0.5 * max((V - R)^2, (V_old + clamp(V - V_old, -c, c) - R)^2)

and ``0.5 * (V - R)^2`` with ``value_clip: null``, times ``scale`` (default 1). Like the policy's ratio clip it keeps one
batch from moving the critic far from where it stood; once ``V`` has moved more than ``c`` from
``V_old`` in the direction that lowers the error, the clipped term is the larger one and the
token gives no gradient. The per-token losses are summed over the loss tokens and divided by
the global count of loss tokens, so micro-batches and data-parallel ranks add up to the mean
over the global batch.

Masking: every input is replaced by 0 off the loss tokens with ``where`` before it is squared,
so a value left there (NaN, inf) reaches neither the loss nor the gradient.

Metrics (additive, divided by the global token count, or ``Min`` / ``Max``, see
``common.py``): ``value_loss``; ``value_clip_fraction``, the fraction of tokens where the
clipped term is in force (0 without clipping); ``value_mean`` (of ``V``) with ``value_min`` /
``value_max``; ``returns_mean``; ``value_abs_error``, the mean ``|V - R|``.
"""

from __future__ import annotations

import torch
from pydantic import Field

from rl_algorithms.losses.common import global_count, masked_extreme
from rl_data.batch import TrainBatch
from rl_distributed.config import ConfigModel
from rl_models.interfaces import Max, Min, Values


class ValueLossConfig(ConfigModel):
    # How far (in value units) one batch may move the critic's prediction from V_old before
    # the clipped term takes over; None: no clipping, the plain squared error.
    value_clip: float | None = Field(0.2, gt=0)
    # A factor on the loss (and so on the critic's gradient; NeMo RL's value_loss_fn.scale).
    scale: float = Field(1.0, gt=0)


class ClippedValueLossFn:
    """``loss_fn`` for training the critic on PPO batches (module docstring for the keys)."""

    # The critic passes its value predictions [B, S] (not log-probs) as the first argument.
    input_type = Values
    METRICS = frozenset(
        {
            "value_loss",
            "value_clip_fraction",
            "value_mean",
            "value_min",
            "value_max",
            "returns_mean",
            "value_abs_error",
        }
    )

    def __init__(self, config: ValueLossConfig | dict | None = None) -> None:
        self.config = ValueLossConfig.model_validate(config or {})

    def batch_fields(self) -> frozenset[str]:
        """The ``TrainBatch`` fields this loss reads besides the ids and masks."""
        return frozenset({"values", "returns"})

    def _need(self, batch: TrainBatch, name: str, width: int, like: torch.Tensor) -> torch.Tensor:
        return batch.need(name, "ClippedValueLossFn", "[B, S]")[:, :width].to(like)

    def __call__(
        self,
        values: torch.Tensor,
        batch: TrainBatch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if values.dim() != 2:
            raise ValueError(f"ClippedValueLossFn expects [B, S] values, got {list(values.shape)}")
        width = values.shape[1]
        mask = batch.loss_token_mask().to(values)
        on = mask > 0
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        value = torch.where(on, values, zero)
        old = torch.where(on, self._need(batch, "values", width, values), zero)
        returns = torch.where(on, self._need(batch, "returns", width, values), zero)

        unclipped = (value - returns).square()
        clip = self.config.value_clip
        if clip is not None:
            clipped_value = old + (value - old).clamp(-clip, clip)
            clipped = (clipped_value - returns).square()
            per_token = 0.5 * torch.maximum(unclipped, clipped)
            clip_active = (clipped > unclipped).to(values)
        else:
            per_token = 0.5 * unclipped
            clip_active = torch.zeros_like(values)

        toks = global_count(global_valid_toks, values)
        loss = self.config.scale * (per_token * mask).sum() / toks

        def token_mean(x: torch.Tensor) -> float:
            return float((x.detach() * mask).sum() / toks)

        metrics = {
            "value_loss": float(loss.detach()),
            "value_clip_fraction": token_mean(clip_active),
            "value_mean": token_mean(value),
            "value_min": masked_extreme(value, mask, Min),
            "value_max": masked_extreme(value, mask, Max),
            "returns_mean": token_mean(returns),
            "value_abs_error": token_mean((value - returns).abs()),
        }
        return loss, metrics
