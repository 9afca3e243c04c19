"""The on-policy distillation loop: the student samples, a frozen teacher scores every sampled
token, the student moves towards the teacher on its own samples.

One step, top to bottom (``distill_train``)::

    prompts -> refit the generator if stale -> roll out (GRPO's steps) -> the teacher's
    log-probs of the sampled tokens (loss_fn.estimator: sampled_token) or its top-k
    log-probs per position (topk) -> with distillation.grpo_reward, GRPO's advantages
    -> the student's train step on the distillation loss (+ GRPO's) -> metrics;
    validation every val_period steps; checkpoint every save_period steps
"""

from __future__ import annotations

import torch

from rl_algorithms.advantages import grpo_advantages
from rl_algorithms.config import TokenizerConfig
from rl_algorithms.distill.config import MasterConfig
from rl_algorithms.grpo.loop import run_and_report, setup_rollout_run, train_steps
from rl_algorithms.grpo.steps import (
    compute_logprobs,
    generate_rollouts,
    refit_if_stale,
    shaped_rewards,
    train_step,
)
from rl_algorithms.losses import ClippedPGLossFn, DistillationLossFn
from rl_algorithms.rollouts import RolloutResult
from rl_algorithms.run import (
    ModelPlan,
    Run,
)
from rl_data.batch import TrainBatch

PHASES = ("refit", "generation", "teacher", "advantages", "logprobs", "train")


def setup(config: MasterConfig) -> Run:
    """GRPO's run (tokenizer, prompts, student, generator, environments, logger) plus the
    teacher; the teacher's vocabulary is checked against the student's first."""
    check_vocabularies(config)
    teacher = config.teacher
    plan = ModelPlan(
        teacher.worker_config(),
        teacher.colocated,
        teacher.num_workers,
        offload_when_idle=teacher.offload.when_idle is True,
    )
    return setup_rollout_run(config, "distill", make_loss(config), teacher=plan)


def make_loss(config: MasterConfig) -> DistillationLossFn:
    """The distillation loss, with GRPO's clipped policy gradient beside it if asked."""
    pg_loss = None
    if config.distillation.grpo_reward:
        pg_loss = ClippedPGLossFn(config.grpo_loss_fn, pi_old_is_current=True)
    return DistillationLossFn(config.loss_fn, pg_loss=pg_loss)


def check_vocabularies(config: MasterConfig) -> None:
    """Student and teacher must share one vocabulary (refused before any worker starts)."""
    from rl_data.tokenizers import check_same_vocabulary, load_tokenizer

    teacher = config.teacher
    if teacher.tokenizer is None and teacher.model.path is None:
        # A teacher built from a config has no tokenizer of its own: it reads the student's
        # token ids, so its vocabulary must at least be large enough.
        vocab = (teacher.model.hf_config or {}).get("vocab_size")
        student = (config.policy.model.hf_config or {}).get("vocab_size")
        if vocab is not None and student is not None and vocab != student:
            raise ValueError(
                f"teacher.model.hf_config.vocab_size ({vocab}) differs from the student's "
                f"policy.model.hf_config.vocab_size ({student}): they must share a vocabulary"
            )
        return
    if teacher.tokenizer is not None:
        teacher_tokenizer, key = teacher.tokenizer, "teacher.tokenizer.path"
    else:
        teacher_tokenizer, key = TokenizerConfig(path=teacher.model.path), "teacher.model.path"
    check_same_vocabulary(
        load_tokenizer(config.tokenizer),
        load_tokenizer(teacher_tokenizer),
        student_name=f"tokenizer.path {config.tokenizer.path}",
        teacher_name=f"{key} {teacher_tokenizer.path}",
    )


def teacher_scores(run: Run, batch: TrainBatch) -> dict[str, torch.Tensor]:
    """What the loss reads of the teacher: its log-probs of the sampled tokens, or its top-k
    log-probs and their ids at every position. A teacher offloaded between its turns
    (``teacher.offload.when_idle``) comes back for this and leaves again after."""
    config: MasterConfig = run.config
    in_turns = run.is_taking_turns(run.teacher)
    if in_turns:
        run.teacher.prepare_for_lp_inference()
    if config.loss_fn.estimator == "sampled_token":
        teacher = run.teacher.get_logprobs(batch, at_loss_tokens=True)
        scores = {"teacher_logprobs": teacher["logprobs"]}
    else:
        topk = run.teacher.get_topk_logprobs(batch, config.distillation.topk_logits_k)
        scores = {
            "teacher_topk_logprobs": topk["topk_logprobs"],
            "teacher_topk_ids": topk["topk_ids"],
        }
    if in_turns:
        run.teacher.offload()
    return scores


def reward_fields(
    run: Run, result: RolloutResult, loss_mask: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Reward metrics, and with ``grpo_reward`` GRPO's group-normalised advantages."""
    rewards = shaped_rewards(run, result)
    metrics = {
        "reward_mean": float(result.rewards.mean()),
        "reward_std": float(result.rewards.std()) if len(rewards) > 1 else 0.0,
    }
    d = run.config.distillation
    sample_mask = result.sample_mask()
    scored = sample_mask > 0  # a real reward: only these make their group's baseline
    if d.overlong_filtering:
        sample_mask = sample_mask * (~result.truncated).to(sample_mask.dtype)
    fields: dict[str, torch.Tensor] = {"sample_mask": sample_mask}
    if d.grpo_reward:
        per_sample = grpo_advantages(rewards, d.num_generations_per_prompt, scored=scored)
        fields["advantages"] = (per_sample[:, None] * loss_mask).to(torch.float32)
    return fields, metrics


def distill_step(run: Run) -> dict[str, float]:
    timer = run.logger.timer
    with timer("refit"):
        refit_metrics = refit_if_stale(run)
    with timer("generation"):
        result, rollout_metrics = generate_rollouts(run)
    run.recent_samples = result.samples(run.config.logger.num_val_samples_to_print)
    batch = result.training_batch(run.tokenizer.pad_token_id)
    with timer("teacher"):
        batch = batch.replace(**teacher_scores(run, batch))
    with timer("advantages"):
        fields, reward_metrics = reward_fields(run, result, batch.loss_mask)
    batch = batch.replace(**fields)
    if run.config.distillation.grpo_reward and run.config.grpo_loss_fn.reference_policy_kl_penalty:
        with timer("logprobs"):
            batch = batch.replace(**compute_logprobs(run, batch, frozenset({"reference_logprobs"})))
    with timer("train"):
        train_metrics = train_step(run, batch)
    return {**train_metrics, **reward_metrics, **rollout_metrics, **refit_metrics}


def distill_train(run: Run) -> dict[str, float]:
    """Train the student for ``distillation.max_num_steps`` steps."""
    return train_steps(run, distill_step)


def main(config: MasterConfig) -> dict[str, float]:
    return run_and_report(setup(config), distill_train, PHASES, "Distillation run")
