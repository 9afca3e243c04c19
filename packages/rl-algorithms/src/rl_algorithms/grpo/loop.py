"""The synchronous GRPO loop, and ``main``: setup, the loop (sync or async), the report.

One step, top to bottom (``grpo_train``)::

    prompts (num_prompts_per_step) -> repeat x num_generations_per_prompt
    -> refit the generator if its weights are stale -> roll out (generate, environment steps,
       possibly several turns) -> rewards (+ overlong shaping) -> advantages
    -> log-probs under the current policy (pi_old) and the reference
    -> clipped policy-gradient train step(s) -> metrics; validation every val_period steps;
       checkpoint every checkpointing.save_period steps
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rl_algorithms.diagnostics import warn_on_mismatch
from rl_algorithms.grpo.config import MasterConfig, RLMasterConfig
from rl_algorithms.grpo.steps import (
    check_batch_fields,
    generate_rollouts,
    make_loss,
    refit_if_stale,
    train_on_rollouts,
    validate,
)
from rl_algorithms.run import (
    DataPlan,
    ModelPlan,
    Run,
    end_step,
    setup_run,
    start_loop,
)
from rl_algorithms.utils.report import report_run

PHASES = ("refit", "generation", "rewards_and_advantages", "logprobs", "train")


def setup(config: MasterConfig, loss_fn: Any = None) -> Run:
    """Tokenizer, prompts, cluster(s), policy, generator, environments, logger; resumes from
    the latest checkpoint in ``checkpointing.checkpoint_dir`` if there is one. ``loss_fn``
    (default: the clipped policy gradient of ``loss_fn.*``) is checked against the fields a
    step produces before anything starts."""
    loss_fn = make_loss(config) if loss_fn is None else loss_fn
    check_batch_fields(loss_fn, config)
    return setup_rollout_run(config, "grpo", loss_fn)


def setup_rollout_run(config: RLMasterConfig, name: str, loss_fn: Any, **models: ModelPlan) -> Run:
    """``setup_run`` for a loop that samples from its policy and scores the samples (GRPO,
    PPO, distillation) and trains it with ``loss_fn``: prompts of the loop section, the
    policy, its generator, the environments, and ``models`` beside them (``critic=``,
    ``teacher=``)."""
    from rl_data.collate import rl_collate

    loop = config.rollout
    data = DataPlan(
        "prompt",
        rl_collate,
        batch_size=loop.num_prompts_per_step,
        val_batch_size=loop.val_batch_size,
        shuffle=config.data.shuffle,
        val_drop_last=False,
    )
    return setup_run(
        config,
        name=name,
        seed=loop.seed,
        data=data,
        policy=config.policy.worker_config(),
        generator=config.generation.plan(
            config.policy.model, config.cluster.use_gpus, config.policy.lora
        ),
        envs=config.env,
        loss_fn=loss_fn,
        max_steps=loop.max_num_steps,
        max_epochs=loop.max_num_epochs,
        val_period=loop.val_period,
        val_at_end=loop.val_at_end,
        **models,
    )


def grpo_step(run: Run) -> dict[str, float]:
    """One synchronous GRPO step: refit, roll out, then the shared tail (train_on_rollouts)."""
    timer = run.logger.timer
    with timer("refit"):
        refit_metrics = refit_if_stale(run)
    with timer("generation"):
        result, rollout_metrics = generate_rollouts(run)
    step_metrics = train_on_rollouts(run, result)
    return {**step_metrics, **rollout_metrics, **refit_metrics}


def grpo_train(run: Run) -> dict[str, float]:
    """Train for ``grpo.max_num_steps`` steps (``max_num_epochs`` of prompts at most)."""
    return train_steps(run, grpo_step)


def train_steps(run: Run, step: Callable[[Run], dict[str, float]]) -> dict[str, float]:
    """The synchronous loop of every rollout algorithm (GRPO, PPO, distillation): validation
    at the start if asked, then ``step`` until ``run.total_steps``, each ended by ``end_step``
    (log, validate, checkpoint). Returns the last step's metrics."""
    start_loop(run, lambda: validate(run), run.config.rollout.val_at_start)
    last: dict[str, float] = {}
    while run.step < run.total_steps:
        step_start = time.perf_counter()
        last = step(run)
        run.step += 1
        last.update(warn_on_mismatch(run, last))
        last["step_seconds"] = time.perf_counter() - step_start  # wall clock, all phases
        end_step(run, last, lambda: validate(run))
    run.logger.progress.stop()
    return last


def main(config: MasterConfig) -> dict[str, float]:
    if config.grpo.async_grpo.enabled:
        from rl_algorithms.grpo.async_loop import async_grpo_train

        return run_and_report(setup(config), async_grpo_train, PHASES, "GRPO run")
    return run_and_report(setup(config), grpo_train, PHASES, "GRPO run")


def run_and_report(
    run: Run, train: Callable[[Run], dict[str, float]], phases: tuple[str, ...], title: str
) -> dict[str, float]:
    """Run ``train`` on ``run``, shut it down whatever happens, then print and plot the run's
    report (the phases' times, reward and accuracy first and last)."""
    resumed_at = run.step
    try:
        last = train(run)
    finally:
        run.shutdown()
    try:
        report_run(run, resumed_at, phases, title=title)
    except Exception as e:  # the run itself succeeded: a failed plot must not turn it red
        print(f"could not write the run's report: {e!r}")
    return last
