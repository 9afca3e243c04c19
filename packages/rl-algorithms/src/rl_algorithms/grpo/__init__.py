"""GRPO (and RLOO, REINFORCE++, DAPO-style variants): sample, score, compare, push.

    rl grpo --config examples/configs/grpo_math.yaml grpo.max_num_steps=100

- ``config.py``: ``MasterConfig`` and the loop's settings (NeMo RL's ``grpo.*`` keys);
- ``steps.py``: the steps of a GRPO step, each returning what it computes;
- ``loop.py``: ``setup``, the synchronous loop ``grpo_train`` and ``main``;
- ``async_loop.py``, ``collector.py``, ``replay_buffer.py``: asynchronous GRPO
  (``grpo.async_grpo.enabled``), where the generator keeps sampling while the trainer trains.

With ``generation.colocated`` the generator shares the policy's workers' resources and they
take turns; otherwise it gets ``generation.num_workers`` workers of its own. With
``grpo.use_dynamic_sampling`` (DAPO) groups whose rewards are all equal are dropped and more
prompts are rolled out, up to ``grpo.dynamic_sampling_max_gen_batches`` rounds. With
``grpo.advantage_estimator: reinforce_plus_plus`` and ``loss_fn.use_kl_in_reward``, the KL
penalty to the reference goes into the per-token returns instead of the loss (the log-probs are
then taken before the advantages). With ``grpo.advantage_estimator: gdpo`` each of the
environments' rewards (``RolloutResult.reward_components``) is normalised within its group on
its own before they are weighted, summed and whitened over the batch.
"""

from rl_algorithms.grpo.config import DEFAULT_RECIPE, MAIN_RECIPE, MasterConfig
from rl_algorithms.grpo.loop import PHASES, grpo_train, main, setup
from rl_algorithms.grpo.steps import (
    compute_advantages,
    compute_logprobs,
    generate_rollouts,
    refit_if_stale,
    response_length,
    rollout_prompts,
    shaped_rewards,
    single_update_per_batch,
    train_step,
    validate,
)

__all__ = [
    "DEFAULT_RECIPE",
    "MAIN_RECIPE",
    "PHASES",
    "MasterConfig",
    "compute_advantages",
    "compute_logprobs",
    "generate_rollouts",
    "grpo_train",
    "main",
    "refit_if_stale",
    "response_length",
    "rollout_prompts",
    "setup",
    "shaped_rewards",
    "single_update_per_batch",
    "train_step",
    "validate",
]
