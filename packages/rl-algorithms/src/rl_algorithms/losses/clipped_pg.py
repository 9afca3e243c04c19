"""The clipped policy-gradient loss of GRPO / PPO-style training, with a KL to the reference.

Data (``[B, S]`` tensors aligned like the policy's log-probs, see ``rl_models.interfaces``):

- ``input_ids``, ``input_lengths``, ``loss_mask`` (1 on generated tokens), ``sample_mask``;
- ``advantages`` ``[B, S]`` (a per-sample advantage broadcast over its tokens, or per token);
- ``prev_logprobs``: log-probs of the policy that the batch is trained from (pi_old), taken by
  the training backend before the first optimiser step (with ``pi_old_is_current``, when the
  batch gets one optimiser step, it may be left out: pi_old is then the current policy);
- ``generation_logprobs``: the generator's log-probs of the sampled tokens (for the
  importance-sampling correction and ``token_mult_prob_error``);
- ``reference_logprobs``: the frozen reference (only when the KL penalty is on).

Per token, with ``ratio = pi / pi_old`` and ``A`` the advantage::

    pg   = max(-A * ratio, -A * clamp(ratio, 1 - ratio_clip_min, 1 + ratio_clip_max))
    pg   = min(pg, -A * ratio_clip_c)            where A < 0 (dual clip, if ratio_clip_c)
    loss = w * pg + reference_policy_kl_penalty * kl(pi, pi_ref)

``w`` is the importance weight ``pi_old / pi_gen`` (detached) that corrects for a generator whose
numerics differ from the trainer's (``use_importance_sampling_correction``), capped at
``truncated_importance_sampling_ratio`` (TIS). With ``sequence_level_importance_ratios`` (GSPO)
both ratios are per sequence: the geometric mean over its tokens, ``exp(mean_t log ratio)``.

Other objectives replace ``pg`` (both with per-token ratios, ``r = ratio``):

- ``use_cispo`` (CISPO, MiniMax-M1): ``pg = -sg(clamp(r, 1 - ratio_clip_min, 1 +
  ratio_clip_max)) * A * log pi``. The clipped ratio is a detached weight, so every token keeps
  a REINFORCE gradient ``-w A grad log pi``; clipping bounds its size instead of dropping it.
  ``ratio_clip_min`` may be 1 here (no lower bound), as CISPO is usually run.
- ``use_sapo`` (SAPO, Qwen): ``pg = -A * (4 / tau) * sigmoid(tau * (r - 1))`` with ``tau =
  sapo_tau_pos`` where ``A > 0`` and ``sapo_tau_neg`` elsewhere: a soft gate whose gradient,
  ``4 p (1 - p)`` times the unclipped one (``p`` the sigmoid), is exactly it at ``r = 1`` and
  fades smoothly as the ratio leaves 1, instead of the hard clip's cut. The paper's objective
  is the mean over sequences of each one's token mean: ``token_level_loss: false``.

Neither combines with ``ratio_clip_c`` or ``sequence_level_importance_ratios``.

The generator's weight ``w`` may instead be truncated or masked
(``truncated_importance_sampling_type``: tis, icepop, seq-mask-tis), and off-policy negative
sequences dropped (``off_policy_sequence_mask_delta``): see ``mismatch.py``, which also computes the k1 / k3
generator-trainer KL diagnostics reported whenever the batch has the generator's log-probs.

Entropy bonus (``entropy_coef`` > 0): ``loss -= entropy_coef * H``, ``H_t = -sum_v pi(v) log
pi(v)`` the entropy of the policy's whole next-token distribution at each loss token, reduced
like the rest of the loss (the token, sample or constant normalisation below) and not weighted
by the importance weights or masks of the corrections: it rewards spreading the distribution
wherever the loss trains. The loss then asks the policy for ``LossTokenLogprobsAndEntropy``
(the entropy and its gradient come from the same chunks of logits as the log-probs); at 0
(the default) it asks for log-probs only, and nothing more is computed.

``kl`` is the k1, k2 or k3 estimator of KL(pi || pi_ref) per token from ``d = log pi_ref - log
pi`` (clamped to ``±kl_input_clamp_value``): k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1, each
then clamped to ``±kl_output_clamp_value``. ``use_on_policy_kl_approximation`` weights it by
``pi / pi_gen`` (detached), making it an estimate of the KL of the current policy, not the
generator's.

Normalisation: ``token_level_loss`` sums every token's loss and divides by the global count of
loss tokens (a sample weighs as many tokens as it has); otherwise each sample's loss is its
token mean, summed and divided by the global count of samples (each sample weighs the same,
whatever its length). Left out (``null``), it follows the ratios: token-level with per-token
ratios (GRPO, DAPO), sample-level with ``sequence_level_importance_ratios``, which is the GSPO
paper's objective (the mean over sequences of each one's clipped term); GSPO with
``token_level_loss: true`` weights each sequence by its length instead.
``constant_length_normalizer`` (Dr. GRPO) replaces both: the sum of every token's loss divided by the global
count of samples times that constant (e.g. the maximum response length), so that neither a
sequence's length nor the batch's token count rescales a token's gradient.

Masking: every position outside the loss tokens (prompt, padding, a sample with
``sample_mask`` 0) is replaced by 0 with ``where`` before any ``exp``, so that a value there
(a backend may pass every position's log-prob, and the KL clamps may be off) can neither
overflow into ``inf * 0 = NaN`` nor reach the gradient. Such a sample adds nothing to the loss,
its gradient or the global counts (the workers count with the same mask).

Metrics: ``clip_fraction`` is the fraction of loss tokens where the clipped term is the one in
force (ratio above ``1 + ratio_clip_max`` with a positive advantage, or below ``1 -
ratio_clip_min`` with a negative one: those tokens have no gradient), as TRL and veRL count it;
``probs_ratio_outside_clip_range`` counts every ratio outside the range, whatever the sign.
Under CISPO ``clip_fraction`` counts the tokens whose weight was clipped (none loses its
gradient); under SAPO nothing is clipped (both are 0) and ``sapo_gate_weight`` is the mean of
the gate's gradient scale ``4 p (1 - p)`` (1 on-policy).
``sampled_token_entropy`` is the mean of ``-log pi(y_t)`` over the loss tokens: the policy sees
only its sampled tokens' log-probs here, not its whole distribution, so this is the Monte-Carlo
estimate of its mean per-token entropy, unbiased when the tokens were sampled from pi itself
(on-policy, at the temperature the trainer scores at); for tokens from a lagging generator it
estimates the cross-entropy of the generator's distribution under pi instead. With the entropy
bonus on, ``token_entropy`` is the exact mean of ``H_t`` over the loss tokens.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from pydantic import Field, model_validator

from rl_algorithms.losses.common import global_count, masked_extreme
from rl_algorithms.losses.mismatch import (
    MISMATCH_METRICS,
    importance_weights,
    masked,
    mismatch_diagnostics,
    off_policy_sequence_keep,
    per_sequence,
)
from rl_data.batch import TrainBatch
from rl_distributed.config import ConfigModel
from rl_models.interfaces import LossTokenLogprobs, LossTokenLogprobsAndEntropy, Max, Min

# What a batch with the generator's log-probs adds to the metrics.
GENERATOR_METRICS = MISMATCH_METRICS | {"token_mult_prob_error"}


class ClippedPGLossConfig(ConfigModel):
    ratio_clip_min: float = Field(0.2, ge=0)  # ratio is clipped below at 1 - ratio_clip_min
    ratio_clip_max: float = Field(0.2, ge=0)  # and above at 1 + ratio_clip_max
    ratio_clip_c: float | None = Field(None, gt=1)  # dual clip (None: off); > 1 by definition
    # Weight of the KL(pi || pi_ref) penalty per token (0, off; needs
    # policy.reference_policy.enabled).
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    # KL estimator, k1 (-d), k2 (d^2 / 2) or k3 (exp(d) - d - 1), with d = log pi_ref - log pi.
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    # d is clamped to +-this before the estimator (None, no clamp).
    kl_input_clamp_value: float | None = Field(20.0, gt=0)
    # The estimator's value is clamped to +-this (None, no clamp).
    kl_output_clamp_value: float | None = Field(10.0, gt=0)
    # Weight the KL by pi / pi_gen, estimating the current policy's KL rather than the generator's.
    use_on_policy_kl_approximation: bool = False
    # Weight each token's loss by pi_old / pi_gen, correcting for the generator's numerics.
    use_importance_sampling_correction: bool = False
    # Cap on that importance weight (TIS; None, no cap).
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0)
    # What an out-of-bounds generator weight becomes (mismatch.py): clamped ("tis", also when
    # left out), its token masked ("icepop") or its sequence masked by the geometric-mean
    # weight ("seq-mask-tis"). The bounds: [ratio_min, truncated_importance_sampling_ratio].
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    # Lower bound of that range (tis: default 0; icepop and seq-mask-tis need it).
    truncated_importance_sampling_ratio_min: float | None = Field(None, ge=0)
    # Drop the negative-advantage tokens of sequences whose mean log pi_gen - log pi exceeds
    # this (DeepSeek-V3.2's off-policy sequence masking; None, off).
    off_policy_sequence_mask_delta: float | None = Field(None, ge=0)
    # Ratios per sequence, the geometric mean over its tokens (GSPO).
    sequence_level_importance_ratios: bool = False
    # CISPO: a clipped, detached ratio weighting -A * log pi (module docstring).
    use_cispo: bool = False
    # SAPO: a soft sigmoid gate instead of the clip, its temperature by the advantage's sign.
    use_sapo: bool = False
    # SAPO's gate temperature for tokens with a positive advantage (higher: a sharper gate).
    sapo_tau_pos: float = Field(1.0, gt=0)
    # SAPO's gate temperature for the others (the paper makes it the larger one).
    sapo_tau_neg: float = Field(1.05, gt=0)
    # None: follow the ratios (token-level, or sequence-level for GSPO), see the module docstring
    token_level_loss: bool | None = None
    # Dr. GRPO: the loss is its token sum over (global samples * this constant), e.g. the
    # maximum response length (None, off; then token_level_loss decides).
    constant_length_normalizer: float | None = Field(None, gt=0)
    # Weight of the entropy bonus: loss -= entropy_coef * the policy's full-vocabulary token
    # entropy over the loss tokens (0: off, and not computed).
    entropy_coef: float = Field(0.0, ge=0)

    @property
    def token_level(self) -> bool:
        """Whether the loss is a mean over tokens (else over samples): ``token_level_loss``, or
        when it is left out, per-token unless the ratios are per sequence (GSPO's paper)."""
        if self.token_level_loss is None:
            return not self.sequence_level_importance_ratios
        return self.token_level_loss

    @model_validator(mode="after")
    def _consistent(self) -> ClippedPGLossConfig:
        # CISPO only weights by the clipped ratio, so a lower bound of 0 (min 1) is allowed.
        if self.ratio_clip_min > 1 or (self.ratio_clip_min == 1 and not self.use_cispo):
            bound = "<= 1 with use_cispo" if self.use_cispo else "< 1 (<= 1 with use_cispo)"
            raise ValueError(f"ratio_clip_min must be {bound}, got {self.ratio_clip_min}")
        self._check_objectives()
        self._check_truncation()
        if self.constant_length_normalizer is not None and self.token_level_loss is not None:
            raise ValueError(
                "constant_length_normalizer replaces the token/sample normalisation: leave "
                "token_level_loss out"
            )
        if (
            self.truncated_importance_sampling_ratio is not None
            and not self.use_importance_sampling_correction
        ):
            raise ValueError(
                "truncated_importance_sampling_ratio needs use_importance_sampling_correction: true"
            )
        return self

    def _check_objectives(self) -> None:
        if self.use_cispo and self.use_sapo:
            raise ValueError("use_cispo and use_sapo are different objectives; pick one")
        # Keys the chosen objective ignores, set away from their defaults (a recipe may list
        # every key at its default): SAPO over a recipe's clip (say DAPO's clip-higher, as
        # examples/configs/grpo_math.yaml has) is a plain switch, so that is said, not refused;
        # SAPO's temperatures without SAPO are a slip, and refused.
        if self.use_sapo and (
            changed := self._away_from_default("ratio_clip_min", "ratio_clip_max")
        ):
            warnings.warn(
                f"loss_fn.use_sapo replaces the clip with a soft gate: {changed} does nothing "
                "(the gate's sharpness is sapo_tau_pos and sapo_tau_neg)",
                stacklevel=2,
            )
        if not self.use_sapo and (
            changed := self._away_from_default("sapo_tau_pos", "sapo_tau_neg")
        ):
            raise ValueError(f"{changed} would do nothing without use_sapo: true")
        objective = "use_cispo" if self.use_cispo else "use_sapo" if self.use_sapo else None
        if objective is not None and self.ratio_clip_c is not None:
            raise ValueError(
                f"ratio_clip_c (dual clip) applies to the clipped objective only, not {objective}"
            )
        if objective is not None and self.sequence_level_importance_ratios:
            raise ValueError(
                f"{objective} weights each token by its own ratio: it does not combine with "
                "sequence_level_importance_ratios"
            )
        if self.use_cispo and self.token_level_loss is False:
            raise ValueError("use_cispo is a token-level loss (token_level_loss: false given)")

    def _away_from_default(self, *keys: str) -> str:
        """``key=value`` for each of ``keys`` whose value is not its default, comma-separated."""
        fields = type(self).model_fields
        return ", ".join(
            f"{k}={getattr(self, k)}" for k in keys if getattr(self, k) != fields[k].default
        )

    def _check_truncation(self) -> None:
        kind = self.truncated_importance_sampling_type
        hi, lo = (
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
        )
        if (kind is not None or lo is not None) and hi is None:
            raise ValueError(
                "truncated_importance_sampling_type and truncated_importance_sampling_ratio_min "
                "need truncated_importance_sampling_ratio (the upper bound)"
            )
        if kind in ("icepop", "seq-mask-tis") and lo is None:
            raise ValueError(
                f"truncated_importance_sampling_type {kind!r} needs "
                "truncated_importance_sampling_ratio_min (the lower bound)"
            )
        # A weight of 1 (generator and trainer agree) must be kept as it is: a range without
        # it would mask or rescale every token of a run with no mismatch at all.
        if hi is not None and not (lo or 0.0) <= 1.0 <= hi:
            raise ValueError(
                "[truncated_importance_sampling_ratio_min, truncated_importance_sampling_ratio] "
                f"must hold 1 (a token whose generator and trainer agree), got [{lo}, {hi}]: "
                "they are bounds on the weight, not offsets from 1"
            )
        if kind == "seq-mask-tis" and self.sequence_level_importance_ratios:
            raise ValueError(
                "seq-mask-tis masks sequences but keeps per-token weights; it does not combine "
                "with sequence_level_importance_ratios"
            )


def kl_estimate(
    logprobs: torch.Tensor, reference: torch.Tensor, config: ClippedPGLossConfig
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (see the module docstring)."""
    d = reference - logprobs
    if config.kl_input_clamp_value is not None:
        d = d.clamp(-config.kl_input_clamp_value, config.kl_input_clamp_value)
    if config.reference_policy_kl_type == "k1":
        kl = -d
    elif config.reference_policy_kl_type == "k2":
        kl = 0.5 * d.square()
    else:
        kl = torch.exp(d) - d - 1
    if config.kl_output_clamp_value is not None:
        kl = kl.clamp(-config.kl_output_clamp_value, config.kl_output_clamp_value)
    return kl


def masked_kl_estimate(
    logprobs: torch.Tensor,
    reference: torch.Tensor,
    mask: torch.Tensor,
    config: ClippedPGLossConfig,
) -> torch.Tensor:
    """``kl_estimate`` in float64 on the tokens where ``mask > 0``, 0 elsewhere: both inputs
    are zeroed off the mask first (every estimator is 0 there), so a prompt position's -inf
    log-prob cannot turn into NaN. What a KL-in-reward penalty (PPO, REINFORCE++) folds in."""
    on = mask > 0
    zero = torch.zeros((), dtype=torch.float64, device=logprobs.device)
    return kl_estimate(
        torch.where(on, logprobs.to(torch.float64), zero),
        torch.where(on, reference.to(torch.float64), zero),
        config,
    )


class ClippedPGLossFn:
    """``loss_fn`` for ``Policy.train`` on GRPO batches (module docstring for the keys)."""

    # Every log-prob read is multiplied by (or selected with) the loss-token mask: the policy
    # may skip the output layer on prompt tokens.
    input_type = LossTokenLogprobs
    # The metrics _metrics returns under every config (``token_mult_prob_error`` needs the
    # generator's log-probs in the batch, so it is not among them). An instance's ``METRICS``
    # adds those its config guarantees (``config_metrics``).
    METRICS = frozenset(
        {
            "loss",
            "kl_penalty",
            "probs_ratio",
            "probs_ratio_min",
            "probs_ratio_max",
            "probs_ratio_clamped",
            "clip_fraction",
            "probs_ratio_outside_clip_range",
            "sampled_token_entropy",
        }
    )

    def __init__(
        self, config: ClippedPGLossConfig | dict | None = None, *, pi_old_is_current: bool = False
    ) -> None:
        self.config = ClippedPGLossConfig.model_validate(config or {})
        if self.config.entropy_coef > 0:
            # [B, S, 2]: the log-probs and the whole distribution's entropy at each token.
            self.input_type = LossTokenLogprobsAndEntropy
        # A batch trained with a single optimiser step is scored by pi_old itself: without
        # ``prev_logprobs`` in the batch, the current log-probs (detached) stand in for them,
        # which saves the trainer a whole forward pass per step. Off, a missing key is an error.
        self.pi_old_is_current = pi_old_is_current
        # What a run logs under this config (what checkpointing.metric_name may rank by).
        self.METRICS = ClippedPGLossFn.METRICS | self.config_metrics()

    def config_metrics(self) -> frozenset[str]:
        """The metrics every call returns under this config besides the class's ``METRICS``:
        the entropy bonus's ``token_entropy``, SAPO's gate, the corrections' masked fractions,
        and the generator/trainer mismatch when the config makes the generator's log-probs
        required (a batch that merely carries them adds those metrics too)."""
        cfg = self.config
        names: set[str] = set()
        if cfg.entropy_coef > 0:
            names.add("token_entropy")
        if cfg.use_sapo:
            names.add("sapo_gate_weight")
        if (
            cfg.use_importance_sampling_correction
            and cfg.truncated_importance_sampling_ratio is not None
            and cfg.truncated_importance_sampling_type is not None
        ):
            names.add("is_oob_ratio")
        if cfg.off_policy_sequence_mask_delta is not None:
            names |= {"off_policy_masked_token_fraction", "off_policy_masked_seq_fraction"}
        if self._needs_gen():
            names |= GENERATOR_METRICS
        return frozenset(names)

    def batch_fields(self) -> frozenset[str]:
        """The ``TrainBatch`` fields this loss reads under its config besides the ids and masks,
        so a run can check them at setup instead of failing at the first step."""
        cfg = self.config
        fields = {"advantages"}
        if not self.pi_old_is_current:
            fields.add("prev_logprobs")
        if self._needs_gen():
            fields.add("generation_logprobs")
        if cfg.reference_policy_kl_penalty > 0:
            fields.add("reference_logprobs")
        return frozenset(fields)

    def _needs_gen(self) -> bool:
        cfg = self.config
        return (
            cfg.use_importance_sampling_correction
            or cfg.use_on_policy_kl_approximation
            or cfg.off_policy_sequence_mask_delta is not None
        )

    def _need(self, batch: TrainBatch, name: str, width: int, like: torch.Tensor) -> torch.Tensor:
        return batch.need(name, "ClippedPGLossFn", "[B, S]")[:, :width].to(like)

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: TrainBatch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        logprobs, entropy = self._split(logprobs)
        width = logprobs.shape[1]
        mask = batch.loss_token_mask().to(logprobs)
        advantages = self._need(batch, "advantages", width, logprobs)
        if batch.prev_logprobs is None and self.pi_old_is_current:
            prev = logprobs.detach()
        else:
            prev = self._need(batch, "prev_logprobs", width, logprobs)
        gen = (
            self._need(batch, "generation_logprobs", width, logprobs)
            if (self._needs_gen() or batch.generation_logprobs is not None)
            else None
        )

        log_ratio = masked(logprobs - prev, mask) * mask
        if cfg.sequence_level_importance_ratios:
            log_ratio = per_sequence(log_ratio, mask)
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
        extra: dict[str, float] = {}
        if cfg.use_cispo:
            # The weight is detached: the gradient is -w A grad log pi on every token.
            pg = -advantages * clipped.detach() * masked(logprobs, mask)
        elif cfg.use_sapo:
            pg, gate = self._sapo(ratio, advantages)
            clipped = ratio  # nothing is clipped
            extra["sapo_gate_weight"] = gate
        else:
            pg = torch.maximum(-advantages * ratio, -advantages * clipped)
            if cfg.ratio_clip_c is not None:
                dual = torch.minimum(pg, -advantages * cfg.ratio_clip_c)
                pg = torch.where(advantages < 0, dual, pg)

        outside = None
        if cfg.use_importance_sampling_correction:
            assert gen is not None
            weight, outside = importance_weights(prev, gen, mask, cfg)
            pg = pg * weight
        dropped = None
        if cfg.off_policy_sequence_mask_delta is not None:
            assert gen is not None
            keep, dropped = off_policy_sequence_keep(
                logprobs, gen, advantages, mask, cfg.off_policy_sequence_mask_delta
            )
            pg = pg * keep

        per_token = pg
        kl = torch.zeros_like(logprobs)
        if cfg.reference_policy_kl_penalty > 0:
            reference = self._need(batch, "reference_logprobs", width, logprobs)
            # Inputs zeroed off the loss tokens (d = 0 there, whose KL is 0 for k1, k2 and k3).
            kl = kl_estimate(masked(logprobs, mask), masked(reference, mask), cfg)
            if cfg.use_on_policy_kl_approximation:
                assert gen is not None
                kl = kl * torch.exp(masked(logprobs - gen, mask) * mask).detach()
            per_token = per_token + cfg.reference_policy_kl_penalty * kl
        if entropy is not None:
            # masked: a backend may give every position's entropy; only loss tokens count.
            per_token = per_token - cfg.entropy_coef * masked(entropy, mask)

        toks = global_count(global_valid_toks, logprobs)
        seqs = global_count(global_valid_seqs, logprobs)
        if cfg.constant_length_normalizer is not None:
            divisor = seqs * cfg.constant_length_normalizer

            def reduce(x: torch.Tensor) -> torch.Tensor:
                return (x * mask).sum() / divisor
        elif cfg.token_level:

            def reduce(x: torch.Tensor) -> torch.Tensor:
                return (x * mask).sum() / toks
        else:
            sample_tokens = mask.sum(dim=1).clamp(min=1)
            samples = batch.sample_valid_mask().to(logprobs)

            def reduce(x: torch.Tensor) -> torch.Tensor:
                return ((x * mask).sum(dim=1) / sample_tokens * samples).sum() / seqs

        loss = reduce(per_token)
        metrics = self._metrics(
            loss, logprobs, ratio, clipped, advantages, kl, prev, gen, mask, toks, reduce
        )
        if entropy is not None:
            extra["token_entropy"] = masked(entropy, mask).detach()
        if extra:
            metrics.update({k: float((v * mask).sum() / toks) for k, v in extra.items()})
        samples = batch.sample_valid_mask().to(logprobs)
        if outside is not None and cfg.truncated_importance_sampling_type is not None:
            # Tokens (tis, icepop) or sequences (seq-mask-tis) whose weight was out of bounds.
            if outside.dim() == 1:
                metrics["is_oob_ratio"] = float((outside.to(samples) * samples).sum() / seqs)
            else:
                metrics["is_oob_ratio"] = float((outside.to(mask) * mask).sum() / toks)
        if dropped is not None:
            metrics["off_policy_masked_token_fraction"] = float(((1 - keep) * mask).sum() / toks)
            metrics["off_policy_masked_seq_fraction"] = float(
                (dropped.to(samples) * samples).sum() / seqs
            )
        return loss, metrics

    def _split(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ``[B, S]`` log-probs, and with the entropy bonus on the ``[B, S]`` entropies,
        of what the policy gave (``input_type``)."""
        if self.config.entropy_coef == 0:
            return values, None
        if values.dim() != 3 or values.shape[-1] != 2:
            raise ValueError(
                f"loss_fn.entropy_coef={self.config.entropy_coef} needs [B, S, 2] log-probs and "
                "token entropies (input_type LossTokenLogprobsAndEntropy) from the policy, got "
                f"shape {tuple(values.shape)}"
            )
        return values[..., 0], values[..., 1]

    def _sapo(
        self, ratio: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SAPO's per-token loss and the gate's gradient scale ``4 p (1 - p)`` (detached)."""
        cfg = self.config
        tau = torch.where(
            advantages > 0,
            torch.full_like(ratio, cfg.sapo_tau_pos),
            torch.full_like(ratio, cfg.sapo_tau_neg),
        )
        p = torch.sigmoid(tau * (ratio - 1))
        return -advantages * (4 / tau) * p, (4 * p * (1 - p)).detach()

    def _metrics(
        self, loss, logprobs, ratio, clipped, advantages, kl, prev, gen, mask, toks, reduce
    ) -> dict[str, float]:
        """Token means are divided by the global token count (additive over micro-batches)."""
        ratio, clipped, advantages = ratio.detach(), clipped.detach(), advantages.detach()

        def token_mean(x: torch.Tensor) -> float:
            # where, not a product: a prompt token's exp|prev - gen| may overflow to inf
            return float(torch.where(mask > 0, x.detach(), 0.0).sum() / toks)

        metrics = {
            "loss": float(loss.detach()),
            "kl_penalty": float(reduce(kl.detach())),
            "probs_ratio": token_mean(ratio),
            "probs_ratio_min": masked_extreme(ratio, mask, Min),
            "probs_ratio_max": masked_extreme(ratio, mask, Max),
            "probs_ratio_clamped": token_mean(clipped),
            # The clipped term is in force where it is the larger loss (module docstring).
            "clip_fraction": token_mean(self._clip_active(ratio, clipped, advantages)),
            "probs_ratio_outside_clip_range": token_mean((ratio != clipped).to(ratio)),
            # The entropy estimate of the module docstring: -log pi of the sampled tokens.
            "sampled_token_entropy": token_mean(-logprobs),
        }
        if gen is not None:
            # Mean of exp|log pi_old - log pi_gen| over tokens: 1 when the trainer and the
            # generator agree exactly on the sampled tokens' probabilities.
            metrics["token_mult_prob_error"] = token_mean(torch.exp((prev - gen).abs()))
            metrics.update(mismatch_diagnostics(prev, gen, mask, toks))
        return metrics

    def _clip_active(self, ratio, clipped, advantages) -> torch.Tensor:
        """Where the clip is in force: for CISPO wherever the weight was clipped (the token
        keeps a gradient), else where the clipped term is the larger loss (no gradient)."""
        if self.config.use_cispo:
            return (ratio != clipped).to(ratio)
        return (-advantages * clipped > -advantages * ratio).to(ratio)
