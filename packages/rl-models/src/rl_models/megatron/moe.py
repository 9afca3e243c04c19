"""The routers' load-balancing loss of a mixture-of-experts ``GPTModel``, for one training step.

Megatron computes it in each MoE layer (``moe_router_load_balancing_type="aux_loss"``: the
Switch Transformer loss ``E / (k T^2) * sum_i tokens_i * probs_i`` over the layer's ``T``
tokens), multiplies it by ``moe_aux_loss_coeff`` and, because the worker sets
``calculate_per_token_loss``, by the micro-batch's token count ``n``; its gradient is injected in
backward (``MoEAuxLossAutoScaler``, scale 1 here), and its unscaled value is logged in Megatron's
tracker. The worker's losses are already means over the global batch, so for the step
``MoeAuxLoss`` sets the coefficient to ``coeff / N`` (``N``: the tokens the model sees in the
global batch, every data-parallel rank's micro-batches, padding included since it is routed
too). The gradient is then that of ``loss + coeff * A`` with ``A = sum_m n_m a_m / N``, the
token-weighted mean over micro-batches ``m`` of ``a_m``, the layers' losses summed; ``A`` is the
``moe_aux_loss`` metric (each data-parallel replica's share, summed over the replicas by the
metric reduction). It is logged in training steps only: Megatron's routers add the loss only
in training mode with gradients on, so an evaluation would read 0.

With sequence parallelism each tensor-parallel rank routes its slice of the sequence and
computes its part of each layer's loss (the probabilities of its own tokens against the whole
micro-batch's expert counts; the parts add up to the loss). Megatron scales each part by the
rank's own token count, ``n / tp``, not ``n``, so the coefficient is multiplied by ``tp`` to
keep the gradient that of ``loss + coeff * A``. (The router splits over tensor x context
parallel ranks; this backend has no context parallelism. No padding mask is passed, so
Megatron counts padding tokens too, as ``N`` does.)

The metric is read per micro-batch from the tracker on every pipeline stage (each stage's
tracker holds its own layers), right after the stage's forward of that micro-batch, and summed
over the model-parallel group (the stages, and the tensor-parallel ranks' parts) at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)

from rl_models.megatron.forward import Inputs

#: Megatron's tracker entry for ``moe_router_load_balancing_type="aux_loss"``.
TRACKER_KEY = "load_balancing_loss"


class MoeAuxLoss:
    """Scales the load-balancing loss for one step (``with``) and adds up its metric."""

    def __init__(
        self,
        model: torch.nn.Module,
        coeff: float,
        inputs: list[Inputs],
        all_reduce: Callable[[torch.Tensor], torch.Tensor],
        sequence_split: int = 1,
    ) -> None:
        """``all_reduce``: the sum over the data-parallel group (the global token count);
        ``sequence_split``: the ranks each micro-batch's sequence is split over (the
        tensor-parallel size with sequence parallelism, else 1)."""
        self.model = model
        self.config = model.config
        self.enabled = bool(getattr(self.config, "num_moe_experts", None)) and coeff > 0
        self.coeff = coeff
        self.sequence_split = sequence_split
        # Kept on the model's device, read once (``total``): a read per micro-batch would make
        # the stages before the last (which read nothing else) wait for the device before
        # sending their activations on.
        self.value = torch.zeros((), dtype=torch.float64)
        self._seen = torch.zeros((), dtype=torch.float64)
        if self.enabled:
            device = next(iter(model.parameters())).device
            self.value, self._seen = self.value.to(device), self._seen.to(device)
            local = torch.tensor(float(sum(i.input_ids.numel() for i in inputs)))
            self.tokens = float(all_reduce(local.double()))

    def _logged(self) -> torch.Tensor:
        entry = get_moe_layer_wise_logging_tracker().get(TRACKER_KEY)
        return entry["values"].sum().double() if entry else torch.zeros_like(self._seen)

    def __enter__(self) -> MoeAuxLoss:
        if self.enabled:
            clear_aux_losses_tracker()
            scale = self.sequence_split / max(self.tokens, 1.0)
            self.config.moe_aux_loss_coeff = self.coeff * scale
        return self

    def after_forward(self, inp: Inputs) -> None:
        """After this stage's forward of micro-batch ``inp``: add its layers' share of the
        metric."""
        if not self.enabled:
            return
        logged = self._logged()
        self.value += (logged - self._seen) * (inp.input_ids.numel() / self.tokens)
        self._seen = logged

    def total(self) -> float:
        """The metric of this replica: every stage's layers, every tensor-parallel part (a
        collective over the model-parallel group)."""
        value = self.value.clone()
        group = parallel_state.get_model_parallel_group()
        if dist.get_world_size(group=group) > 1:
            dist.all_reduce(value, group=group)
        return float(value)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.config.moe_aux_loss_coeff = self.coeff
            clear_aux_losses_tracker()
