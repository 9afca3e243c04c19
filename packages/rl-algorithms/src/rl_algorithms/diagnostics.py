"""Warnings the driver gives from a step's metrics when a number says the run is going wrong.

The generator/trainer mismatch: the loss reports ``gen_train_kl_k3``, the mean over the loss
tokens of the k3 estimate of KL(pi_gen || pi_old) (``losses/mismatch.py``). k3 rather than k1:
both estimate the same KL from the sampled tokens, but k3 is never negative per token, so a
mean over a batch cannot hide a large gap behind tokens whose errors cancel, and its variance
is lower. Between a bfloat16 vLLM generator and its trainer the value is typically near 1e-3
(NeMo RL's GRPO guide, after the "When Speed Kills Stability" study of training-inference
mismatch, which ties runs' collapse to its growth); the same dtype and fresh weights on both
sides give about 0. The default threshold, 1e-2, is ten times the healthy value: a gap that
large comes from a cause worth checking, not from rounding alone.
"""

from __future__ import annotations

import warnings
from typing import Any

from rl_algorithms.losses.distillation import PG_METRIC_PREFIX

MISMATCH_METRIC = "gen_train_kl_k3"
# The count of steps above the threshold, logged as train/<this> and kept in run.extra (a
# resumed run goes on counting and does not warn again).
MISMATCH_COUNT = "mismatch_kl_warn_steps"


def warn_on_mismatch(run: Any, metrics: dict[str, float]) -> dict[str, float]:
    """Count the steps whose ``gen_train_kl_k3`` exceeds ``<loop>.mismatch_kl_warn_threshold``
    and warn the first time one does, with the step, the value, the threshold and what to
    check. Returns the count as a metric to log, or nothing when the step reported no
    generator log-probs or the threshold is off (null)."""
    threshold = run.config.rollout.mismatch_kl_warn_threshold
    # Distillation's loss reports its policy-gradient part's metrics under a prefix.
    kl = metrics.get(MISMATCH_METRIC, metrics.get(PG_METRIC_PREFIX + MISMATCH_METRIC))
    if threshold is None or kl is None:
        return {}
    count = run.extra.get(MISMATCH_COUNT, 0)
    if kl > threshold:
        count += 1
        if count == 1:
            _warn(run, kl, threshold)
    run.extra[MISMATCH_COUNT] = count
    return {MISMATCH_COUNT: float(count)}


def _warn(run: Any, kl: float, threshold: float) -> None:
    key = f"{run.config.LOOP_SECTION}.mismatch_kl_warn_threshold"
    warnings.warn(
        f"step {run.step}: the generator and the trainer score the sampled tokens differently: "
        f"{MISMATCH_METRIC} = {kl:.3g} exceeds {key} = {threshold:g} (healthy runs sit near "
        "1e-3 or below). Check that the generator samples in the precision the trainer "
        "computes in (generation.dtype or generation.vllm.dtype against policy.model.dtype and "
        "policy.mixed_precision), and that the generator holds this step's weights (a stale "
        "or failed refit); in an asynchronous run the policy's lag adds to the gap. "
        "loss_fn.use_importance_sampling_correction with truncated_importance_sampling_ratio "
        f"corrects for a moderate gap. Warned once; train/{MISMATCH_COUNT} counts the steps "
        f"above the threshold ({key}: null turns this off).",
        RuntimeWarning,
        stacklevel=2,
    )
