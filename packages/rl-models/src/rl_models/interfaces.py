"""What the algorithms see of a policy, and what a loss function must look like.

Data conventions (keys of the ``BatchedDataDict`` a policy takes):

- ``input_ids`` ``[B, S]``: right-padded token ids; ``input_lengths`` ``[B]``: real lengths.
- ``token_mask`` ``[B, S]`` (training): 1 where a token's log-prob counts in the loss.
- ``sample_mask`` ``[B]`` (training, optional): 0 drops a whole sample.

Log-probs are next-token log-probs aligned to the input: ``logprobs[:, t] =
log p(input_ids[t] | input_ids[<t])``, 0 at position 0 and on padding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from rl_distributed.batched_data_dict import BatchedDataDict

LossInput = Literal["logprobs", "loss_token_logprobs", "gathered_logprobs", "logits", "values"]
LOSS_INPUTS = ("logprobs", "loss_token_logprobs", "gathered_logprobs", "logits", "values")


@runtime_checkable
class LossFunction(Protocol):
    """A loss over one micro-batch whose gradients do not depend on how a batch is split.

    What the first argument holds: by default ``[B, S]`` next-token log-probs (see the module
    docstring). A loss with the class attribute ``input_type = "logits"`` gets ``[B, S, V]``
    next-token logits aligned the same way (``[:, t]`` predicts token ``t``; zeros at position
    0 and on padding), for losses over the whole vocabulary (entropy, distillation). A loss
    that reads log-probs only where ``losses.loss_token_mask`` is non-zero (and multiplies
    them by it) may say ``input_type = "loss_token_logprobs"``: the policy then computes the
    output layer and its log-softmax at those tokens alone (the response, not the prompt) and
    passes 0 elsewhere; a backend without that saving passes every log-prob, which such a
    loss must accept as well. A sequence-classifier policy (reward model) always passes its
    ``[B, num_labels]`` scores. A value model (``model.kind: value``, a critic) passes
    ``[B, S]`` values aligned like log-probs (``[:, t]`` values the state that chose token
    ``t``) to a loss with ``input_type = "values"``.

    ``input_type = "gathered_logprobs"`` (distillation over a teacher's top-k): the batch
    carries ``teacher_topk_ids`` ``[B, S, k]`` (aligned like the log-probs: ``[:, t]`` are
    tokens of the distribution that predicts token ``t``), and the loss gets ``[B, S, 1 + k]``
    log-probs: ``[..., 0]`` those of the input tokens (what "loss_token_logprobs" gives, so a
    policy-gradient term can be added), ``[..., 1:]`` those of ``teacher_topk_ids``, each a
    log-softmax over the whole vocabulary. Like "loss_token_logprobs" they are computed at the
    loss tokens only (0 elsewhere), without a ``[tokens, vocab]`` tensor. The DTensor backend
    provides it; the Megatron backend refuses such a loss.

    ``global_valid_seqs`` and ``global_valid_toks`` count the valid samples and loss tokens of
    the whole *global* batch (all micro-batches, all data-parallel ranks). A token-level loss
    sums over its micro-batch and divides by ``global_valid_toks``, so that summing the
    micro-batch losses of every rank gives the global-batch mean, however the batch was cut.
    Returns the loss (a scalar tensor with grad) and float metrics.
    """

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def loss_input_type(loss_fn: LossFunction) -> LossInput:
    """What ``loss_fn`` wants to be given: "logprobs" (the default), "loss_token_logprobs",
    "gathered_logprobs", "logits" or "values"."""
    kind = getattr(loss_fn, "input_type", "logprobs")
    if kind not in LOSS_INPUTS:
        raise ValueError(
            f"{type(loss_fn).__name__}.input_type is {kind!r}; expected one of "
            + ", ".join(repr(k) for k in LOSS_INPUTS)
        )
    return kind


class PolicyInterface(ABC):
    """A trainable language-model policy, however it is placed and parallelised."""

    @abstractmethod
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """``{"logprobs": [B, S]}`` of the current weights, in ``data``'s row order."""

    @abstractmethod
    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """``{"reference_logprobs": [B, S]}`` of the frozen initial weights."""

    @abstractmethod
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """One optimiser step per ``gbs`` rows of ``data``; returns per-step metrics.

        With ``eval_mode`` the losses are computed but nothing is updated.
        """

    @abstractmethod
    def prepare_for_training(self) -> None:
        """Get ready for ``train`` (e.g. load weights and optimiser state onto the device)."""

    @abstractmethod
    def prepare_for_lp_inference(self) -> None:
        """Get ready for log-prob inference (e.g. move optimiser state away)."""

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Write HF-loadable weights plus optimiser and scheduler state to ``path``."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers and their resources."""
