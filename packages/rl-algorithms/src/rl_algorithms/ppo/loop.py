"""The PPO loop: GRPO's rollouts, a critic's values, GAE, then the critic's and the policy's
train steps.

One step, top to bottom (``ppo_train``)::

    prompts -> refit the generator if stale -> roll out (GRPO's steps) -> log-probs of the
    policy (pi_old) and the reference -> the critic's values (a colocated critic on GPUs
    leaves the device between its turns: critic.offload.when_idle) -> token-level rewards (the
    score at the last response token, minus the KL penalty per token with use_kl_in_reward)
    -> GAE advantages and returns -> critic_ppo_epochs passes of the clipped value loss
    -> ppo_epochs passes of the clipped policy loss (from policy_training_start_step on)
    -> metrics; validation every val_period steps; checkpoint (policy and critic)
"""

from __future__ import annotations

from typing import Any

import torch

from rl_algorithms.grpo.config import builtin_loss
from rl_algorithms.grpo.loop import run_and_report, setup_rollout_run, train_steps
from rl_algorithms.grpo.steps import (
    ADVANTAGE_FIELDS,
    ROLLOUT_FIELDS,
    check_batch_fields,
    compute_logprobs,
    generate_rollouts,
    refit_if_stale,
    shaped_rewards,
    single_update_per_batch,
    warn_if_no_signal,
)
from rl_algorithms.losses import ClippedPGLossFn, ClippedValueLossFn
from rl_algorithms.losses.clipped_pg import masked_kl_estimate
from rl_algorithms.ppo.config import MasterConfig
from rl_algorithms.ppo.gae import explained_variance, gae, token_level_rewards, whiten
from rl_algorithms.rollouts import RolloutResult
from rl_algorithms.run import ModelPlan, Run, reduce_step_metrics
from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict

PHASES = ("refit", "generation", "logprobs", "values", "advantages", "critic_train", "train")


def setup(config: MasterConfig) -> Run:
    """GRPO's run (tokenizer, prompts, policy, generator, environments, logger) plus the
    critic; resumes both from the latest checkpoint in ``checkpointing.checkpoint_dir``."""
    critic = config.critic
    plan = ModelPlan(
        critic.worker_config(),
        critic.colocated,
        critic.num_workers,
        offload_when_idle=critic.offload.when_idle is True,
    )
    # The policy's loss is checked against what a PPO step produces before anything starts.
    loss_fn = make_loss(config)
    check_batch_fields(loss_fn, config, step_fields(config), step="PPO")
    return setup_rollout_run(config, "ppo", loss_fn, critic=plan)


def make_loss(config: MasterConfig) -> Any:
    """The policy's clipped PG loss (its KL term off when the KL is in the rewards), or the
    loss of your own that ``loss_fn.kind`` names."""
    if builtin_loss(config) is None:
        return config.loss_fn.build()
    pi_old_is_current = "prev_logprobs" not in logprob_fields(config)
    return ClippedPGLossFn(config.loss_fn.policy_loss(), pi_old_is_current=pi_old_is_current)


def step_fields(config: MasterConfig) -> frozenset[str]:
    """The ``TrainBatch`` fields a PPO step fills before the policy's train step."""
    return ROLLOUT_FIELDS | ADVANTAGE_FIELDS | {"returns", "values"} | logprob_fields(config)


def logprob_fields(config: MasterConfig) -> frozenset[str]:
    """What ``grpo.steps.compute_logprobs`` must give a PPO step: ``prev_logprobs`` for more
    than one optimiser step per batch (pi_old) or for the KL penalty in the rewards, the
    reference's log-probs whenever there is a KL penalty; for a loss of your own, either one
    its ``batch_fields()`` lists."""
    fields = set()
    loss = builtin_loss(config)
    several_steps = not single_update_per_batch(config) or config.ppo.ppo_epochs > 1
    if several_steps or (loss is not None and loss.use_kl_in_reward):
        fields.add("prev_logprobs")
    if loss is not None and loss.reference_policy_kl_penalty > 0:
        fields.add("reference_logprobs")
    if loss is None:
        fields |= config.loss_fn.batch_fields() & {"prev_logprobs", "reference_logprobs"}
    return frozenset(fields)


def compute_advantages(
    run: Run, result: RolloutResult, batch: TrainBatch, values: BatchedDataDict
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``advantages``, ``returns``, ``values`` (the critic's, before its update) and
    ``sample_mask`` for the batch, and their metrics."""
    config: MasterConfig = run.config
    p, loss = config.ppo, builtin_loss(config)
    scores = shaped_rewards(run, result)
    sample_mask = result.sample_mask()
    if p.overlong_filtering:
        sample_mask = sample_mask * (~result.truncated).to(sample_mask.dtype)
    mask = batch.replace(sample_mask=sample_mask).loss_token_mask()
    kl_in_reward = loss is not None and loss.use_kl_in_reward
    kl_args: dict[str, Any] = {}
    if kl_in_reward:
        kl_args = {
            "kl_penalty": loss.reference_policy_kl_penalty,
            "logprobs": batch.prev_logprobs,
            "reference_logprobs": batch.reference_logprobs,
            "kl_type": loss.reference_policy_kl_type,
            "kl_input_clamp_value": loss.kl_input_clamp_value,
            "kl_output_clamp_value": loss.kl_output_clamp_value,
        }
    rewards = token_level_rewards(scores, mask, **kl_args)
    g = p.adv_estimator
    advantages, returns = gae(
        rewards,
        values["values"],
        mask,
        bootstrap_values(values, mask, batch.input_lengths),
        open_episodes(result),
        gamma=g.gae_gamma,
        lam=g.gae_lambda,
    )
    if g.normalize_advantages:
        advantages = whiten(advantages, mask)
    on = mask > 0
    metrics = {
        "reward_mean": float(result.rewards.mean()),
        "reward_std": float(result.rewards.std()) if len(scores) > 1 else 0.0,
        "shaped_reward_mean": float(scores.mean()),
        "advantages_mean": float(advantages[on].mean()) if on.any() else 0.0,
        "advantages_abs_mean": float(advantages[on].abs().mean()) if on.any() else 0.0,
        "returns_mean": float(returns[on].mean()) if on.any() else 0.0,
        "values_mean": float(values["values"][on].mean()) if on.any() else 0.0,
        # How much of the returns' variance the critic explains (1: all; <= 0: none).
        "explained_variance": explained_variance(values["values"], returns, mask),
        "sample_mask_mean": float(sample_mask.mean()),
    }
    if kl_in_reward and on.any():
        # The loss's kl_penalty is 0 then: this is where the run's drift from the reference shows.
        kl = masked_kl_estimate(
            batch.need("prev_logprobs", "kl_in_reward"),
            batch.need("reference_logprobs", "kl_in_reward"),
            mask,
            loss,
        )
        metrics["kl_in_reward_mean"] = float(kl[on].mean())
    warn_if_no_signal(run, result.rewards)
    fields = {
        "advantages": advantages.to(torch.float32),
        "returns": returns.to(torch.float32),
        "values": values["values"].to(torch.float32),
        "sample_mask": sample_mask,
    }
    return fields, metrics


def open_episodes(result: RolloutResult) -> torch.Tensor:
    """``[B]`` bool: the episodes a GAE recursion bootstraps. A response cut at the length
    limit whose episode the environment did not end: its return goes on past the cut. One the
    environment ended (a single-turn math answer is scored even when cut) is terminal."""
    return result.truncated & ~result.terminated


def bootstrap_values(
    values: BatchedDataDict, mask: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """``[B]`` the critic's value of the state right after each row's last action token:
    where the response was cut. ``values["values"][:, t]`` values the state before token
    ``t``, so that is the aligned value one past the last action token; when nothing follows
    that token in the row, the critic's ``final_values``."""
    aligned = values["values"]
    positions = torch.arange(mask.shape[1])
    last = torch.where(mask > 0, positions, -1).max(dim=1).values  # -1: no action token
    after = (last + 1).clamp(max=mask.shape[1] - 1)
    inside = (last >= 0) & (last + 1 < lengths)
    picked = aligned.gather(1, after[:, None])[:, 0]
    return torch.where(inside, picked, values["final_values"].to(aligned.dtype))


def critic_values(run: Run, batch: TrainBatch) -> BatchedDataDict:
    """The critic's ``values`` and ``final_values`` of the batch; a critic offloaded between
    its turns gets its weights back first (its optimiser state waits for its training)."""
    if run.is_taking_turns(run.critic):
        run.critic.prepare_for_lp_inference()
    return run.critic.get_values(batch)


def train_critic(run: Run, batch: TrainBatch) -> dict[str, float]:
    """``critic_ppo_epochs`` passes of the clipped value loss; metrics under ``critic/``.
    Then the critic leaves the device if it takes turns with the policy (the policy trains
    next), else its optimiser state does with ``critic.offload.optimizer_state``."""
    loss_fn = ClippedValueLossFn(run.config.value_loss_fn)
    run.critic.prepare_for_training()
    results: dict[str, list[Any]] = {}
    for _ in range(run.config.ppo.critic_epochs):
        for key, values in run.critic.train(batch, loss_fn).metrics.items():
            results.setdefault(key, []).extend(values)
    if run.is_taking_turns(run.critic):
        run.critic.offload()
    else:
        run.critic.prepare_for_lp_inference()
    return {f"critic/{k}": v for k, v in reduce_step_metrics(results).items()}


def train_policy(run: Run, batch: TrainBatch) -> dict[str, float]:
    """``ppo_epochs`` passes of the clipped policy loss once the critic's warm-up is over."""
    if run.step < run.config.ppo.policy_training_start_step:
        return {"policy_trained": 0.0}
    run.policy.prepare_for_training()
    results: dict[str, list[Any]] = {}
    for _ in range(run.config.ppo.ppo_epochs):
        for key, values in run.policy.train(batch, run.loss_fn).metrics.items():
            results.setdefault(key, []).extend(values)
    return {**reduce_step_metrics(results), "policy_trained": 1.0}


def ppo_step(run: Run) -> dict[str, float]:
    timer = run.logger.timer
    with timer("refit"):
        refit_metrics = refit_if_stale(run)
    with timer("generation"):
        result, rollout_metrics = generate_rollouts(run)
    run.recent_samples = result.samples(run.config.logger.num_val_samples_to_print)
    batch = result.training_batch(run.tokenizer.pad_token_id)
    with timer("logprobs"):
        batch = batch.replace(**compute_logprobs(run, batch, logprob_fields(run.config)))
    with timer("values"):
        values = critic_values(run, batch)
    with timer("advantages"):
        fields, advantage_metrics = compute_advantages(run, result, batch, values)
    batch = batch.replace(**fields)
    with timer("critic_train"):
        critic_metrics = train_critic(run, batch)
    with timer("train"):
        policy_metrics = train_policy(run, batch)
    return {
        **policy_metrics,
        **critic_metrics,
        **advantage_metrics,
        **rollout_metrics,
        **refit_metrics,
    }


def ppo_train(run: Run) -> dict[str, float]:
    """Train for ``ppo.max_num_steps`` steps (``max_num_epochs`` of prompts at most)."""
    return train_steps(run, ppo_step)


def main(config: MasterConfig) -> dict[str, float]:
    return run_and_report(setup(config), ppo_train, PHASES, "PPO run")
