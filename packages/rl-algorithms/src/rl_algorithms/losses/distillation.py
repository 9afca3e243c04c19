"""Distillation losses: a student trained towards a frozen teacher on the student's own samples
(on-policy distillation), alone or added to GRPO's clipped policy-gradient loss.

Two estimators (``DistillationLossConfig.estimator``):

``"sampled_token"``: on-policy reverse KL on the sampled tokens. Data: ``teacher_logprobs``
``[B, S]``, the teacher's log-prob of each input token (aligned like the policy's log-probs).
At a loss token ``t`` with prefix ``x_<t`` and sampled token ``y_t ~ s(. | x_<t)``, let
``d_t = log s(y_t) - log t(y_t)``. The loss is, per token::

    l_t = sg(d_t) * (log s(y_t) - sg(log s(y_t))) + sg(d_t)

(``sg``: stop-gradient). Its value is ``d_t``, the one-sample (k1) estimate of ``KL(s || t)``
at that position, and its gradient is ``d_t * grad log s(y_t)``: the REINFORCE estimator of
``grad KL(s(. | x_<t) || t(. | x_<t))``, unbiased because ``E_s[grad log s] = 0``, so
``grad KL = E_s[(log s - log t) grad log s]``. What is minimised is the sum over positions of
each position's reverse KL with its prefix held fixed: the dependence of later prefixes on
earlier samples is not differentiated (a per-token reward ``-d_t`` with discount 0, as in the
on-policy distillation of Agarwal et al. (GKD) and Thinking Machines' write-up). The samples
must come from the student being trained (one optimiser step per batch); no importance
correction is applied.

``"topk"``: divergences over the teacher's top-k support. Data: ``teacher_topk_logprobs``
``[B, S, k]`` and ``teacher_topk_ids`` ``[B, S, k]`` (a teacher policy's
``get_topk_logprobs``: ``topk_logprobs`` / ``topk_ids``); the policy gives this loss the
student's log-probs at those ids (``input_type = GatheredLogprobs``). With ``p`` the
teacher's and ``q`` the student's probabilities on the k ids, per position:

- ``kl_type: forward``: ``KL(p || q) = sum_i p_i (log p_i - log q_i)``;
- ``kl_type: reverse``: ``KL(q || p) = sum_i q_i (log q_i - log p_i)``;
- ``kl_type: mixed``: ``mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse``;
- ``kl_type: jsd``: the generalised Jensen-Shannon divergence of TRL's GKD with ``beta =
  jsd_beta``: ``m = beta * p + (1 - beta) * q``, ``beta * KL(p || m) + (1 - beta) * KL(q ||
  m)`` (TRL's ``beta`` 0 and 1 are its forward and reverse KL: use ``kl_type`` for those).

``zero_outside_topk: false`` (NeMo RL's default) renormalises both distributions over the k
ids (``p_i / sum p``, ``q_i / sum q``: each a distribution on the teacher's support).
``zero_outside_topk: true`` uses the full-vocabulary probabilities as they are (the teacher
taken as 0 outside its top-k); only the forward KL is exact then (its terms outside the
support vanish); the others would need the student's mass and entropy over the whole
vocabulary, which this loss is not given, so they are refused.

The config names ``kl_type``, ``mixed_kl_weight`` and ``zero_outside_topk`` are NeMo RL's
(``loss_fn.*`` of its distillation recipe; its ``distillation.topk_logits_k`` is the k the
teacher is asked for). ``kl_weight`` scales the distillation term; a ``ClippedPGLossFn`` given
as ``pg_loss`` is added to it unchanged (GRPO plus distillation), fed the student's log-probs
of the input tokens.

Normalisation and masking as in ``clipped_pg.py``: per-token values are summed over the loss
tokens (``loss_token_mask``) and divided by the global loss-token count; every input off the
loss tokens is replaced by 0 with ``where`` before any ``exp``, so extreme values there add
nothing to the loss or its gradient. Metrics are additive (divided by the global token count)
except the ``Min`` / ``Max`` ones; the policy-gradient loss's metrics come prefixed with
``pg_``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from rl_algorithms.losses.clipped_pg import ClippedPGLossFn
from rl_algorithms.losses.common import global_count
from rl_data.batch import TrainBatch
from rl_distributed.config import ConfigModel
from rl_models.interfaces import GatheredLogprobs, LossTokenLogprobs

# The policy-gradient part's metrics are logged under this prefix (``pg_loss``, ...).
PG_METRIC_PREFIX = "pg_"


class DistillationLossConfig(ConfigModel):
    # topk: divergences over the teacher's top-k per position; sampled_token: reverse KL on
    # the sampled tokens (the teacher's log-prob of each).
    estimator: Literal["sampled_token", "topk"] = "topk"
    kl_type: Literal["forward", "reverse", "mixed", "jsd"] = "mixed"  # topk only
    mixed_kl_weight: float = Field(0.5, ge=0, le=1)  # the forward KL's share in "mixed"
    jsd_beta: float = Field(0.5, gt=0, lt=1)  # TRL GKD's beta, for "jsd"
    zero_outside_topk: bool = False  # topk: False renormalises both over the top-k ids
    kl_weight: float = Field(1.0, ge=0)  # the distillation term's weight

    @model_validator(mode="after")
    def _consistent(self) -> DistillationLossConfig:
        if self.estimator == "topk" and self.zero_outside_topk and self.kl_type != "forward":
            raise ValueError(
                f"zero_outside_topk: true works with kl_type 'forward' only, not "
                f"{self.kl_type!r}: the student's mass and entropy outside the teacher's top-k "
                "are not computed"
            )
        return self


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on the loss tokens, 0 elsewhere (``mask`` ``[B, S]``; ``x`` ``[B, S, ...]``)."""
    keep = (mask > 0).view(*mask.shape, *[1] * (x.dim() - mask.dim()))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def topk_divergence(
    student: torch.Tensor, teacher: torch.Tensor, config: DistillationLossConfig
) -> torch.Tensor:
    """Per-position divergence ``[...]`` from the student's and teacher's log-probs ``[..., k]``
    at the teacher's top-k ids (see the module docstring)."""
    if not config.zero_outside_topk:
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    p, q = teacher.exp(), student.exp()
    forward = (p * (teacher - student)).sum(-1)
    if config.kl_type == "forward":
        return forward
    reverse = (q * (student - teacher)).sum(-1)
    if config.kl_type == "reverse":
        return reverse
    if config.kl_type == "mixed":
        return config.mixed_kl_weight * forward + (1 - config.mixed_kl_weight) * reverse
    beta = config.jsd_beta
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))
    return beta * (p * (teacher - mixture)).sum(-1) + (1 - beta) * (q * (student - mixture)).sum(-1)


class DistillationLossFn:
    """``loss_fn`` for ``Policy.train`` on a student's batches scored by a teacher (module
    docstring for the estimators, keys and normalisation)."""

    def __init__(
        self,
        config: DistillationLossConfig | dict | None = None,
        pg_loss: ClippedPGLossFn | None = None,
    ) -> None:
        self.config = DistillationLossConfig.model_validate(config or {})
        self.pg_loss = pg_loss
        sampled = self.config.estimator == "sampled_token"
        # Both read log-probs at the loss tokens only: the policy may skip the prompt.
        self.input_type = LossTokenLogprobs if sampled else GatheredLogprobs
        own = {"loss", "kl", "student_logprob_mean"}
        own |= {"teacher_logprob_mean"} if sampled else {"teacher_topk_mass", "student_topk_mass"}
        pg = {f"{PG_METRIC_PREFIX}{m}" for m in pg_loss.METRICS} if pg_loss is not None else set()
        self.METRICS = frozenset(own | pg)

    def batch_fields(self) -> frozenset[str]:
        """The ``TrainBatch`` fields this loss reads besides the ids and masks."""
        fields = set()
        if self.config.estimator == "sampled_token":
            fields.add("teacher_logprobs")
        else:
            fields |= {"teacher_topk_logprobs", "teacher_topk_ids"}
        if self.pg_loss is not None:
            fields |= self.pg_loss.batch_fields()
        return frozenset(fields)

    def _need(self, batch: TrainBatch, name: str, shape: str, width: int) -> torch.Tensor:
        reader = f"DistillationLossFn ({self.config.estimator})"
        return batch.need(name, reader, shape)[:, :width]

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: TrainBatch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        width = logprobs.shape[1]
        mask = batch.loss_token_mask().to(logprobs)
        toks = global_count(global_valid_toks, logprobs)

        def token_sum(x: torch.Tensor) -> torch.Tensor:
            return (x * mask).sum() / toks

        metrics: dict[str, float] = {}
        if self.config.estimator == "sampled_token":
            if logprobs.dim() != 2:
                raise ValueError(f"expected [B, S] log-probs, got {tuple(logprobs.shape)}")
            sampled = _masked(logprobs, mask)
            teacher = _masked(
                self._need(batch, "teacher_logprobs", "[B, S]", width).to(sampled), mask
            )
            d = (sampled - teacher).detach()
            # Value d (the k1 estimate of the KL), gradient d * grad log s (module docstring).
            per_token = d * (sampled - sampled.detach()) + d
            metrics["teacher_logprob_mean"] = float(token_sum(teacher.detach()))
        else:
            if logprobs.dim() != 3:
                raise ValueError(
                    "expected [B, S, 1 + k] gathered log-probs (input_type GatheredLogprobs), "
                    f"got {tuple(logprobs.shape)}"
                )
            gathered = _masked(logprobs, mask)
            sampled, student = gathered[..., 0], gathered[..., 1:]
            teacher = self._need(batch, "teacher_topk_logprobs", "[B, S, k]", width)
            if teacher.shape != student.shape:
                raise ValueError(
                    f"teacher_topk_logprobs has shape {tuple(teacher.shape)} but the student's "
                    f"log-probs at teacher_topk_ids have {tuple(student.shape)}"
                )
            teacher = _masked(teacher.to(student), mask)
            per_token = topk_divergence(student, teacher, self.config)
            metrics["teacher_topk_mass"] = float(token_sum(teacher.detach().exp().sum(-1)))
            metrics["student_topk_mass"] = float(token_sum(student.detach().exp().sum(-1)))

        kl = token_sum(per_token)
        loss = self.config.kl_weight * kl
        metrics["kl"] = float(kl.detach())
        metrics["student_logprob_mean"] = float(token_sum(sampled.detach()))
        if self.pg_loss is not None:
            pg, pg_metrics = self.pg_loss(sampled, batch, global_valid_seqs, global_valid_toks)
            loss = loss + pg
            metrics |= {f"{PG_METRIC_PREFIX}{k}": v for k, v in pg_metrics.items()}
        metrics["loss"] = float(loss.detach())
        return loss, metrics
