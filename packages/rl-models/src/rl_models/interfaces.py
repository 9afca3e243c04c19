"""What the algorithms see of a policy, and what a loss function must look like.

A policy takes a ``rl_data.batch.TrainBatch`` (or, for inference, any ``BatchedDataDict``
with ``input_ids`` ``[B, S]``, right-padded, and ``input_lengths`` ``[B]``); its workers
receive it as a ``BatchedDataDict`` whose keys are the batch's field names, and a loss gets
each micro-batch back as a ``TrainBatch``.

Log-probs are next-token log-probs aligned to the input: ``logprobs[:, t] =
log p(input_ids[t] | input_ids[<t])``, 0 at position 0 and on padding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict


class LossInput:
    """What a policy hands a loss as its first argument. A loss names one of the subclasses
    below as its ``input_type`` (the class itself); without one it gets ``Logprobs``, or a
    reward model's ``Scores``."""


class Logprobs(LossInput):
    """``[B, S]`` next-token log-probs of every token (module docstring)."""


class LossTokenLogprobs(LossInput):
    """``[B, S]`` log-probs where ``TrainBatch.loss_token_mask()`` is non-zero, 0 elsewhere: the
    policy may skip the output layer elsewhere (the prompt). A backend without that saving
    gives every log-prob, so such a loss must multiply what it reads by the mask."""


class LossTokenLogprobsAndEntropy(LossInput):
    """``[B, S, 2]`` at the loss tokens (0 elsewhere, as ``LossTokenLogprobs``): ``[..., 0]``
    the log-probs, ``[..., 1]`` the entropy ``-sum_v p_v log p_v`` of the whole next-token
    distribution that predicts each token (under the same temperature), differentiable, with
    no ``[tokens, vocab]`` tensor made when the output layer is chunked. For an entropy bonus.
    A backend may give every position's, so a loss multiplies what it reads by the mask."""


class GatheredLogprobs(LossInput):
    """``[B, S, 1 + k]`` at the loss tokens (0 elsewhere), each a log-softmax over the whole
    vocabulary: ``[..., 0]`` the input token's, ``[..., 1:]`` those of the batch's
    ``teacher_topk_ids`` ``[B, S, k]`` (aligned like the log-probs), with no ``[tokens,
    vocab]`` tensor made. For distillation over a teacher's top-k; DTensor backend only."""


class Logits(LossInput):
    """``[B, S, V]`` next-token logits aligned like the log-probs (``[:, t]`` predicts token
    ``t``; 0 at position 0 and on padding), for losses over the whole vocabulary."""


class Values(LossInput):
    """A value model's (``model.kind: value``) ``[B, S]`` values aligned like the log-probs:
    ``[:, t]`` values the state that chose token ``t``."""


class Scores(LossInput):
    """A sequence classifier's (reward model's) ``[B, num_labels]`` scores."""


class Min(float):
    """A metric that combines by its minimum over micro-batches, ranks and steps (an extreme,
    such as the smallest probability ratio). A plain float metric is additive instead: summed
    over micro-batches and ranks, averaged over steps."""

    __slots__ = ()


class Max(float):
    """A metric that combines by its maximum (see ``Min``)."""

    __slots__ = ()


def combine_metric(
    values: Sequence[float], plain: Callable[[list[float]], float], name: str = "metric"
) -> float:
    """One metric's ``values`` as one number, by the reduction they declare: ``Min`` / ``Max``
    by min / max (and still declared so), plain floats by ``plain`` (a sum, a mean). Values of
    one metric that declare different reductions are an error: the result would depend on
    their order."""
    kinds = {Min if isinstance(v, Min) else Max if isinstance(v, Max) else float for v in values}
    if len(kinds) > 1:
        raise ValueError(
            f"metric {name!r} is returned as {sorted(k.__name__ for k in kinds)} by different "
            "micro-batches or steps; a loss must declare one reduction per metric"
        )
    if isinstance(values[0], Min):
        return Min(min(values))
    if isinstance(values[0], Max):
        return Max(max(values))
    return plain([float(v) for v in values])


@dataclass
class TrainResult:
    """What ``train`` did: its optimiser steps (0 in eval mode) and, per global batch, one
    entry of each metric (the loss's own metrics reduced over micro-batches and ranks)."""

    optimizer_steps: int
    metrics: dict[str, list[float]]


@runtime_checkable
class LossFunction(Protocol):
    """A loss over one micro-batch whose gradients do not depend on how a batch is split.

    The first argument is what the class attribute ``input_type`` (a ``LossInput``) names.
    ``global_valid_seqs`` and ``global_valid_toks`` count the valid samples and loss tokens of
    the whole *global* batch (all micro-batches, all data-parallel ranks). A token-level loss
    sums over its micro-batch and divides by ``global_valid_toks``, so that summing the
    micro-batch losses of every rank gives the global-batch mean, however the batch was cut.
    Returns the loss (a scalar tensor with grad) and float metrics, additive or ``Min`` /
    ``Max``.
    """

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: TrainBatch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


#: Every kind of loss input a policy backend may provide (a closed set: a backend maps each to
#: a forward pass).
LOSS_INPUTS: tuple[type[LossInput], ...] = (
    Logprobs,
    LossTokenLogprobs,
    LossTokenLogprobsAndEntropy,
    GatheredLogprobs,
    Logits,
    Values,
    Scores,
)
#: The string modes losses once declared, and the class each became (for the error message).
_RENAMED_INPUTS = {
    "logprobs": Logprobs,
    "loss_token_logprobs": LossTokenLogprobs,
    "gathered_logprobs": GatheredLogprobs,
    "logits": Logits,
    "values": Values,
}


def loss_input_type(loss_fn: object, default: type[LossInput] = Logprobs) -> type[LossInput]:
    """The ``LossInput`` ``loss_fn`` (a loss or its class) declares as its ``input_type``
    (``default`` if none)."""
    declared = getattr(loss_fn, "input_type", default)
    if declared in LOSS_INPUTS:
        return declared
    owner = loss_fn.__name__ if isinstance(loss_fn, type) else type(loss_fn).__name__
    names = ", ".join(c.__name__ for c in LOSS_INPUTS)
    hint = ""
    if isinstance(declared, str) and declared in _RENAMED_INPUTS:
        hint = f" (the string {declared!r} is now the class {_RENAMED_INPUTS[declared].__name__})"
    raise ValueError(
        f"{owner}.input_type is {declared!r}{hint}; expected one of the LossInput classes of "
        f"rl_models.interfaces: {names}"
    )


class PolicyInterface(ABC):
    """A trainable language-model policy, however it is placed and parallelised."""

    @abstractmethod
    def get_logprobs(
        self, data: TrainBatch | BatchedDataDict, *, at_loss_tokens: bool = False
    ) -> BatchedDataDict:
        """``{"logprobs": [B, S]}`` of the current weights, in ``data``'s row order.

        ``at_loss_tokens``: only where ``TrainBatch.loss_token_mask`` counts (0 elsewhere), all
        a loss or a KL reads. A backend may then skip the other positions' output layer and
        run a group's shared prompt once, which for a GRPO batch is most of the work."""

    @abstractmethod
    def get_reference_policy_logprobs(
        self, data: TrainBatch | BatchedDataDict, *, at_loss_tokens: bool = False
    ) -> BatchedDataDict:
        """``{"reference_logprobs": [B, S]}`` of the frozen initial weights
        (``at_loss_tokens`` as for ``get_logprobs``)."""

    @abstractmethod
    def train(
        self,
        data: TrainBatch | BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """One optimiser step per ``gbs`` rows of ``data``; its steps and per-step metrics.

        With ``eval_mode`` the losses are computed but nothing is updated.
        """

    @abstractmethod
    def prepare_for_training(self) -> None:
        """Get ready for ``train`` (e.g. load weights and optimiser state onto the device)."""

    @abstractmethod
    def prepare_for_lp_inference(self) -> None:
        """Get ready for log-prob inference (e.g. move optimiser state away)."""

    @abstractmethod
    def save_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        """Write HF-loadable weights to ``path``, and the optimiser and scheduler state to
        ``training_state_dir`` (into ``path`` too when it is not given)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers and their resources."""
