"""The steps of a GRPO step, each a function that returns what it computes.

The loops (``loop.py``, ``async_loop.py``) call them in order and put their results into the
training batch themselves, so what the loss reads can be read from the loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from rl_algorithms.advantages import (
    gdpo_advantages,
    groups_with_signal,
    grpo_advantages,
    overlong_filter,
    overlong_penalty,
    reinforce_plus_plus_advantages,
)
from rl_algorithms.grpo.config import (
    MasterConfig,
    RewardScalingConfig,
    RLMasterConfig,
    builtin_loss,
)
from rl_algorithms.losses import ClippedPGLossFn
from rl_algorithms.losses.clipped_pg import masked_kl_estimate
from rl_algorithms.rollouts import RolloutResult, run_rollouts
from rl_algorithms.run import Run, reduce_step_metrics
from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.interfaces import RewardComponents

# The ``TrainBatch`` fields a rollout's ``training_batch`` fills, and those the steps add
# before the train step.
ROLLOUT_FIELDS = frozenset({"input_ids", "input_lengths", "loss_mask", "generation_logprobs"})
ADVANTAGE_FIELDS = frozenset({"advantages", "sample_mask"})


def make_loss(config: MasterConfig) -> ClippedPGLossFn:
    """The clipped policy-gradient loss of ``loss_fn.*`` (without its KL term when
    ``loss_fn.use_kl_in_reward`` puts the KL into the returns), or the loss of your own that
    ``loss_fn.kind`` names."""
    if builtin_loss(config) is None:
        return config.loss_fn.build()
    return ClippedPGLossFn(
        config.loss_fn.policy_loss(), pi_old_is_current=single_update_per_batch(config)
    )


def check_batch_fields(
    loss_fn: Any,
    config: MasterConfig,
    produced: frozenset[str] | None = None,
    step: str = "GRPO",
) -> None:
    """Refuse, at setup, a loss that would read a batch field a ``step`` with this config
    does not produce, rather than failing mid-run: a name that is no ``TrainBatch`` field at
    all (misspelt, or an old name), or one this config leaves empty. ``produced``: the fields
    the step fills (default: a GRPO step's). A loss that declares nothing (no
    ``batch_fields``) is not checked."""
    if not hasattr(loss_fn, "batch_fields"):
        return
    declared = set(loss_fn.batch_fields())
    unknown = declared - TrainBatch.field_names()
    if unknown:
        raise ValueError(
            f"{type(loss_fn).__name__}.batch_fields() names {sorted(unknown)}, which are not "
            f"TrainBatch fields (they are {sorted(TrainBatch.field_names())})"
        )
    if produced is None:
        produced = ROLLOUT_FIELDS | ADVANTAGE_FIELDS | logprob_fields(config)
    missing = declared - produced
    if missing:
        raise ValueError(
            f"{type(loss_fn).__name__} reads batch fields {sorted(missing)} that a {step} step "
            f"with this config does not produce (it produces {sorted(produced)})"
        )


def single_update_per_batch(config: RLMasterConfig) -> bool:
    """One optimiser step per rollout batch: the policy that trains on it is pi_old itself."""
    g = config.rollout
    return (
        config.policy.train_global_batch_size
        == g.num_prompts_per_step * g.num_generations_per_prompt
    )


def logprob_fields(config: MasterConfig) -> frozenset[str]:
    """The fields ``compute_logprobs`` returns under ``config``: ``prev_logprobs`` for more
    than one optimiser step per batch (pi_old) or for the KL in the returns, the reference's
    log-probs whenever there is a KL penalty; for a loss of your own, either one its
    ``batch_fields()`` lists."""
    fields = set()
    loss = builtin_loss(config)
    if not single_update_per_batch(config) or (loss is not None and loss.use_kl_in_reward):
        fields.add("prev_logprobs")
    if loss is not None and loss.reference_policy_kl_penalty > 0:
        fields.add("reference_logprobs")
    if loss is None:
        fields |= config.loss_fn.batch_fields() & {"prev_logprobs", "reference_logprobs"}
    return frozenset(fields)


def refit_if_stale(run: Run) -> dict[str, float]:
    """Copy the policy's weights to the generator when it holds an older version, or when it
    has none of the LoRA adapters the policy sends (``needs_refit``)."""
    from rl_models.generation.refit import needs_refit, refit

    if not needs_refit(run.policy, run.generation):
        return {}

    # A generator that samples in a narrower dtype than the policy trains in gets its weights
    # cast on the way: half the bytes to move for a bf16 generator of an fp32 policy.
    gen = run.config.generation
    dtype = gen.copy_dtype(run.config.cluster.use_gpus)
    dtype = dtype or (gen.model.dtype if gen.model is not None else None)
    dtype = dtype if dtype != run.config.policy.model.dtype else None
    stats = refit(run.policy, run.generation, dtype=dtype)
    return {"refit_bytes": float(stats.bytes), "refit_seconds": stats.seconds}


def rollout_prompts(
    run: Run, prompts: BatchedDataDict, greedy: bool = False, with_env_metrics: bool = True
) -> RolloutResult:
    """Generation (and environment turns) for a batch whose rows are already repeated."""
    run.generation.prepare_for_generation()
    try:
        if run.config.rollout.agent_program is not None:
            # (imported here: the endpoint's web server only where programs are played)
            from rl_algorithms.agent_programs.programs import rollout_through_programs

            result = rollout_through_programs(
                run,
                run.config.rollout.agent_program,
                prompts,
                max_seq_len=run.config.policy.max_total_sequence_length,
                greedy=greedy,
                expected_weight_version=run.policy.weight_version,
                with_env_metrics=with_env_metrics,
            )
        else:
            result = run_rollouts(
                run.generation,
                prompts,
                run.tokenizer,
                run.template,
                run.envs,
                max_seq_len=run.config.policy.max_total_sequence_length,
                max_turns=run.config.rollout.max_rollout_turns,
                greedy=greedy,
                expected_weight_version=run.policy.weight_version,
                with_env_metrics=with_env_metrics,
                loop=run.config.rollout.agent_loop,
            )
    finally:
        run.generation.finish_generation()
    if run.logger is not None:  # the agent loop's time in generate calls and in environments
        for name in ("agent_loop/generation_seconds", "agent_loop/env_step_seconds"):
            run.logger.timer.add(name, result.timings.get(name, 0.0))
    return result


def generate_rollouts(run: Run) -> tuple[RolloutResult, dict[str, float]]:
    """Roll out ``num_prompts_per_step`` prompts x G samples.

    With dynamic sampling, groups whose rewards are all equal are set aside and further prompts
    are rolled out until enough groups carry a signal or ``dynamic_sampling_max_gen_batches``
    rounds are spent; then the batch is filled up with set-aside groups so that its size stays
    what the train step expects. ``RolloutResult.filler`` marks those filler rows:
    ``compute_advantages`` gives them sample mask 0, so they add no gradient and no tokens.
    """
    g = run.config.rollout
    G = g.num_generations_per_prompt
    kept: list[RolloutResult] = []
    set_aside: list[RolloutResult] = []
    rounds = 0
    while True:
        rounds += 1
        prompts = run.next_batch().repeat_interleave(G)
        result = rollout_prompts(run, prompts)
        if not g.use_dynamic_sampling:
            return result, {**result.metrics, "generation_rounds": 1.0}
        signal = groups_with_signal(shaped_rewards(run, result), G)
        for p, has_signal in enumerate(signal.tolist()):
            (kept if has_signal else set_aside).append(result.select(range(p * G, p * G + G)))
        if len(kept) >= g.num_prompts_per_step or rounds >= g.dynamic_sampling_max_gen_batches:
            break
    kept = kept[: g.num_prompts_per_step]
    fillers = [group.as_filler() for group in set_aside[: g.num_prompts_per_step - len(kept)]]
    merged = RolloutResult.concat(kept + fillers)
    return merged, {
        **result.metrics,
        "generation_rounds": float(rounds),
        "dynamic_sampling/groups_with_signal": float(len(kept)),
    }


def scaled(scaling: RewardScalingConfig, rewards: torch.Tensor) -> torch.Tensor:
    """``rewards`` clamped to the source range and mapped linearly onto the target range
    (unchanged when reward scaling is off)."""
    if not scaling.enabled:
        return rewards
    unit = (rewards.clamp(scaling.source_min, scaling.source_max) - scaling.source_min) / (
        scaling.source_max - scaling.source_min
    )
    return scaling.target_min + unit * (scaling.target_max - scaling.target_min)


def shaped_rewards(run: Run, result: RolloutResult) -> torch.Tensor:
    """The environments' rewards, scaled when reward scaling is on, plus the overlong penalty
    when reward shaping is on."""
    shaping = run.config.rollout.reward_shaping
    rewards = scaled(run.config.rollout.reward_scaling, result.rewards.clone())
    penalty = unweighted_overlong_penalty(run, result)
    if penalty is not None:
        rewards += (penalty * shaping.overlong_buffer_penalty).to(rewards.dtype)
    return rewards


def unweighted_overlong_penalty(run: Run, result: RolloutResult) -> torch.Tensor | None:
    """``[N]`` overlong penalties in [-1, 0] before ``overlong_buffer_penalty`` weighs them;
    None when reward shaping is off."""
    shaping = run.config.rollout.reward_shaping
    if not shaping.enabled:
        return None
    lengths = torch.tensor([response_length(log) for log in result.message_logs])
    return overlong_penalty(lengths, shaping.max_response_length, shaping.overlong_buffer_length)


# The name of reward shaping's overlong penalty among GDPO's rewards.
OVERLONG_PENALTY_COMPONENT = "overlong_penalty"


def reward_components(run: Run, result: RolloutResult) -> RewardComponents:
    """The rewards GDPO normalises apart: the environments' components, and reward shaping's
    overlong penalty as one more (weighted by ``overlong_buffer_penalty``), so that their
    weighted sum is ``shaped_rewards``. With reward scaling on, each component is mapped on
    its own (as NeMo RL does): GDPO normalises each apart, so only the clamp changes its
    advantages, and the weighted sum then differs from ``shaped_rewards`` by the map's offset."""
    components = result.reward_components
    if components is None:
        raise ValueError(
            "grpo.advantage_estimator: gdpo needs every sample's reward components, and this "
            "batch has none: an environment returned a single reward (no "
            "EnvironmentReturn.reward_components), or the batch mixes environments whose "
            "rewards differ (names or weights). Use env kind reward_functions with the same "
            "functions for every task, or grpo.advantage_estimator: grpo"
        )
    components = RewardComponents(
        components.names,
        components.weights,
        scaled(run.config.rollout.reward_scaling, components.values.float()),
    )
    penalty = unweighted_overlong_penalty(run, result)
    if penalty is None:
        return components
    return RewardComponents(
        (*components.names, OVERLONG_PENALTY_COMPONENT),
        (*components.weights, run.config.rollout.reward_shaping.overlong_buffer_penalty),
        torch.cat([components.values.float(), penalty[:, None].float()], dim=1),
    )


def gdpo_step_advantages(
    run: Run, result: RolloutResult, sample_mask: torch.Tensor, scored: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """GDPO's ``[N]`` advantages, and each reward's normalised advantage's mean and std over
    the samples in the loss (``gdpo/<reward>/advantage_mean``, ``.../advantage_std``)."""
    g = run.config.grpo
    components = reward_components(run, result)
    advantages, per_reward = gdpo_advantages(
        components.values,
        components.weights,
        g.num_generations_per_prompt,
        leave_one_out=g.use_leave_one_out_baseline,
        normalize_std=g.normalize_rewards,
        sample_mask=sample_mask,
        scored=scored,
    )
    on = sample_mask > 0
    metrics = {}
    for k, name in enumerate(components.names):
        values = per_reward[on, k]
        metrics[f"gdpo/{name}/advantage_mean"] = float(values.mean()) if len(values) else 0.0
        metrics[f"gdpo/{name}/advantage_std"] = float(values.std()) if len(values) > 1 else 0.0
    return advantages, metrics


def response_length(log: list[dict]) -> int:
    return sum(int(m["token_loss_mask"].sum()) for m in log if "token_loss_mask" in m)


def compute_advantages(
    run: Run,
    result: RolloutResult,
    loss_mask: torch.Tensor,
    logprobs: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``advantages`` [B, S] and ``sample_mask`` [B] for the batch, and reward metrics.

    Rows out of the loss (dynamic sampling's fillers, truncated responses under overlong
    filtering) get sample mask 0 and advantage 0, and the estimators' batch statistics
    (REINFORCE++'s and GDPO's whitening) leave them out. With ``loss_fn.use_kl_in_reward`` (REINFORCE++ only), ``logprobs`` holds
    ``compute_logprobs``' fields: the per-token KL of ``prev_logprobs`` (pi_old) to
    ``reference_logprobs`` goes into the returns with ``reference_policy_kl_penalty``.
    """
    g = run.config.grpo
    rewards = shaped_rewards(run, result)
    sample_mask = result.sample_mask()
    # The samples with a real reward (not an environment's timeout or refusal to score):
    # only they make their group's baseline. Truncated ones keep theirs (overlong filtering
    # takes them out of the loss, not out of the statistics).
    scored = sample_mask > 0
    if g.overlong_filtering:
        sample_mask = overlong_filter(result.truncated, sample_mask)
    kl = None
    estimator_metrics: dict[str, float] = {}
    if g.advantage_estimator == "reinforce_plus_plus":
        kl_coef = 0.0
        loss = builtin_loss(run.config)
        if loss is not None and loss.use_kl_in_reward:
            if logprobs is None:
                raise ValueError(
                    "loss_fn.use_kl_in_reward: compute_advantages needs the log-probs "
                    "(compute_logprobs' prev_logprobs and reference_logprobs)"
                )
            kl = masked_kl_estimate(
                logprobs["prev_logprobs"],
                logprobs["reference_logprobs"],
                loss_mask,
                loss,
            )
            kl_coef = loss.reference_policy_kl_penalty
        advantages = reinforce_plus_plus_advantages(
            rewards,
            loss_mask,
            group_size=g.num_generations_per_prompt,
            kl=kl,
            kl_coef=kl_coef,
            sample_mask=sample_mask,
            scored=scored,
        )
    elif g.advantage_estimator == "gdpo":
        per_sample, estimator_metrics = gdpo_step_advantages(run, result, sample_mask, scored)
        advantages = per_sample[:, None] * loss_mask
    else:
        per_sample = grpo_advantages(
            rewards,
            g.num_generations_per_prompt,
            leave_one_out=g.use_leave_one_out_baseline,
            normalize_std=g.normalize_rewards,
            scored=scored,
        )
        advantages = per_sample[:, None] * loss_mask
    advantages = advantages * (~result.filler)[:, None].to(advantages.dtype)
    on = (loss_mask * sample_mask[:, None]) > 0  # the tokens the loss counts
    metrics = {
        "reward_mean": float(result.rewards.mean()),
        "reward_std": float(result.rewards.std()) if len(rewards) > 1 else 0.0,
        "shaped_reward_mean": float(rewards.mean()),
        "advantages_mean": float(advantages[on].mean()) if on.any() else 0.0,
        "advantages_abs_mean": float(advantages[on].abs().mean()) if on.any() else 0.0,
        "sample_mask_mean": float(sample_mask.mean()),
        # Groups whose G rewards are all equal: their advantages are 0, they teach nothing.
        "zero_variance_groups_fraction": 1.0
        - float(groups_with_signal(rewards, g.num_generations_per_prompt).double().mean()),
        **estimator_metrics,
    }
    if g.advantage_estimator == "reinforce_plus_plus" and kl is not None and on.any():
        # The loss's kl_penalty is 0 then: this is where the run's drift from the reference shows.
        metrics["kl_in_reward_mean"] = float(kl[on].mean())
    warn_if_no_signal(run, result.rewards)
    return {"advantages": advantages.to(torch.float32), "sample_mask": sample_mask}, metrics


def warn_if_no_signal(run: Run, rewards: torch.Tensor) -> None:
    """Count the steps in a row whose rewards are all the same, and warn once a streak reaches
    ``grpo.no_signal_warning_steps``: such a run trains on nothing and would otherwise say so
    only through a flat curve. The count lives in ``run.extra`` so a resumed run keeps it."""
    steps = run.config.rollout.no_signal_warning_steps
    if steps == 0:
        return
    identical = len(rewards) > 0 and bool((rewards == rewards[0]).all())
    streak = run.extra.get("no_signal_steps", 0) + 1 if identical else 0
    run.extra["no_signal_steps"] = streak
    if streak == steps:
        warnings.warn(
            f"every reward has been {float(rewards[0]):g} for {steps} steps in a row: there is "
            "no learning signal, so nothing learns. Likely causes: the dataset's answer column "
            "is not the one the environment reads (ground_truth by default), or the prompts do "
            "not ask for the format the environment parses (e.g. <answer> tags). "
            "(grpo.no_signal_warning_steps=0 turns this warning off.)",
            RuntimeWarning,
            stacklevel=2,
        )


def compute_logprobs(
    run: Run, batch: TrainBatch, fields: frozenset[str] | None = None
) -> dict[str, torch.Tensor]:
    """``prev_logprobs`` (the policy before this step) and, for the KL penalty, the
    reference policy's ``reference_logprobs``: the ``fields`` asked for (default: the ones
    ``logprob_fields`` names for GRPO), by their ``TrainBatch`` names.

    Both are taken at the loss's tokens only (0 where ``batch.loss_token_mask()`` is 0), all
    a loss or a KL reads: a group's prompt then runs once, and its positions skip the output
    layer. With a single optimiser step per batch pi_old is the policy being trained, so its
    log-probs come out of the train step's own forward pass (see ``ClippedPGLossFn``).
    """
    fields = logprob_fields(run.config) if fields is None else fields
    if not fields:
        return {}
    run.policy.prepare_for_lp_inference()
    out = {}
    if "prev_logprobs" in fields:
        out["prev_logprobs"] = run.policy.get_logprobs(batch, at_loss_tokens=True)["logprobs"]
    if "reference_logprobs" in fields:
        reference = run.policy.get_reference_policy_logprobs(batch, at_loss_tokens=True)
        out["reference_logprobs"] = reference["reference_logprobs"]
    return out


def train_step(run: Run, batch: TrainBatch) -> dict[str, float]:
    run.policy.prepare_for_training()
    return reduce_step_metrics(run.policy.train(batch, run.loss_fn).metrics)


def train_on_rollouts(run: Run, result: RolloutResult) -> dict[str, float]:
    """The tail every GRPO loop shares, sync or async: the rollouts' training batch gets its
    advantages and the log-probs the loss needs, then the train step runs. Returns the train
    and reward metrics.

    With ``loss_fn.use_kl_in_reward`` the KL to the reference is part of the returns, so the
    log-probs are taken first; otherwise after the advantages (the order of the default path
    is kept: its numbers do not change)."""
    timer = run.logger.timer
    run.recent_samples = result.samples(run.config.logger.num_val_samples_to_print)
    batch = result.training_batch(run.tokenizer.pad_token_id)
    loss = builtin_loss(run.config)
    if loss is not None and loss.use_kl_in_reward:
        with timer("logprobs"):
            logprobs = compute_logprobs(run, batch)
            batch = batch.replace(**logprobs)
        with timer("rewards_and_advantages"):
            advantages, reward_metrics = compute_advantages(
                run, result, batch.loss_mask, logprobs=logprobs
            )
        batch = batch.replace(**advantages)
    else:
        with timer("rewards_and_advantages"):
            advantages, reward_metrics = compute_advantages(run, result, batch.loss_mask)
        batch = batch.replace(**advantages)
        with timer("logprobs"):
            batch = batch.replace(**compute_logprobs(run, batch))
    with timer("train"):
        train_metrics = train_step(run, batch)
    return {**train_metrics, **reward_metrics}


def validate(run: Run) -> dict[str, float]:
    """Greedy rollouts over (up to ``max_val_samples`` of) the validation prompts; the
    environments' metrics of them all as ``env/<task>/...``, and the first
    ``logger.num_val_samples_to_print`` samples logged as examples (``val/samples``).

    The environments' metrics are asked for once, after the last batch: their counts since
    the previous call (each training rollout takes its own) then cover validation only."""
    if run.val_loader is None:
        return {}
    refit_if_stale(run)
    run.val_loader.epoch, run.val_loader.position = 0, 0
    results, seen = [], 0
    for prompts in run.val_loader:
        if seen >= run.config.rollout.max_val_samples:
            break
        results.append(rollout_prompts(run, prompts, greedy=True, with_env_metrics=False))
        seen += prompts.size
    result = RolloutResult.concat(results)
    r = result.rewards
    run.logger.log_samples(
        result.samples(run.config.logger.num_val_samples_to_print), run.step, prefix="val"
    )
    return {
        "reward_mean": float(r.mean()),
        "accuracy": float((r >= 1.0).double().mean()),
        "mean_turns": float(result.turns.double().mean()),
        "num_samples": float(len(r)),
        **result.environment_metrics(run.envs),
    }
