"""``grpo.async_grpo``: the settings of asynchronous GRPO and the checks it needs from the rest
of the run config (kept apart from ``async_grpo.py`` so that ``grpo.py`` can validate a config
without importing the loop)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rl_distributed.config import ConfigModel


class AsyncGRPOConfig(ConfigModel):
    """Generation overlaps training: rollouts for step n come from a policy up to
    ``max_trajectory_age_steps`` steps old, and importance sampling corrects for the lag."""

    enabled: bool = False
    # A sample's age is the trainer's step minus the oldest weight version (in steps) that
    # produced any of its tokens; older samples are dropped (and counted), never trained on.
    max_trajectory_age_steps: int = Field(1, ge=0)
    # true: a refit pauses the engine between two decoding steps and the running generations
    # go on with the new weights; false: the collector lets them finish (drain) first.
    in_flight_weight_updates: bool = True
    # A group (G samples of one prompt, generation and scoring) running longer than this is
    # cancelled and its prompt queued again. Set it well above a normal group's time.
    max_group_seconds: float = Field(300.0, gt=0)
    # A prompt queued again (its group hung, was aborted by vLLM, or was too stale to train
    # on) more often than this stops the run with an error naming the prompt.
    max_requeues_per_prompt: int = Field(3, ge=0)
    # The trainer raises instead of waiting longer than this for one step's groups; a dead,
    # stalled or exhausted collector is reported within seconds regardless.
    max_wait_seconds: float = Field(900.0, gt=0)
    # One call of the collector on a generation engine (submit, poll, cancel); an engine that
    # takes longer is reported as wedged, naming its worker. A worker answers one call at a
    # time, so this must exceed the longest refit or validation generation it runs meanwhile.
    engine_call_seconds: float = Field(300.0, gt=0)
    # Groups the collector may run ahead of the trainer (None: num_prompts_per_step times
    # max(1, max_trajectory_age_steps), what the trainer can use before they grow too old).
    max_groups_ahead: int | None = Field(None, ge=1)


def check_async_config(config: Any) -> None:
    """The run config an asynchronous run needs (called from ``grpo.MasterConfig``'s
    validation, so a bad combination fails before Ray starts); errors name the key."""
    a: AsyncGRPOConfig = config.grpo.async_grpo
    if not a.enabled:
        return
    if a.max_wait_seconds <= a.max_group_seconds:
        raise ValueError(
            f"grpo.async_grpo.max_wait_seconds ({a.max_wait_seconds}) must exceed "
            f"grpo.async_grpo.max_group_seconds ({a.max_group_seconds}): a hung group is "
            "cancelled and generated again before the trainer gives up waiting"
        )
    if not config.loss_fn.use_importance_sampling_correction:
        raise ValueError(
            "grpo.async_grpo.enabled: true trains on samples from older weights: set "
            "loss_fn.use_importance_sampling_correction: true (its ratios correct for the lag)"
        )
    gen = config.generation
    if gen.colocated:
        raise ValueError(
            "grpo.async_grpo.enabled: true needs generation.colocated: false (the generator "
            "runs beside the trainer on workers of its own)"
        )
    if gen.backend != "vllm" or not gen.vllm.async_engine:
        raise ValueError(
            "grpo.async_grpo.enabled: true needs generation.backend: vllm with "
            "generation.vllm.async_engine: true (samples stream back as they finish)"
        )
    if config.grpo.max_rollout_turns != 1:
        raise ValueError(
            f"grpo.max_rollout_turns is {config.grpo.max_rollout_turns}; asynchronous GRPO "
            "(grpo.async_grpo.enabled) supports single-turn rollouts only"
        )
    if config.grpo.use_dynamic_sampling:
        raise ValueError(
            "grpo.use_dynamic_sampling is not supported with grpo.async_grpo.enabled: true"
        )
