"""Adding an algorithm: plain REINFORCE with a batch-mean baseline, on the built-in arithmetic
task. It reuses GRPO's config, run setup and steps; what it adds is a loss and a loop.

    uv run python examples/reinforce.py --config examples/configs/grpo_math_cpu.yaml
"""

import sys

from rl_algorithms import grpo
from rl_algorithms.cli import build_config
from rl_algorithms.grpo.steps import refit_if_stale, rollout_prompts, shaped_rewards, validate
from rl_algorithms.losses.common import global_count
from rl_algorithms.run import Run, end_step, reduce_step_metrics, start_loop
from rl_models.interfaces import LossTokenLogprobs


class ReinforceLoss:
    """-(r - mean r) * log pi(token), summed over the response tokens of the global batch and
    divided by their number, so the gradient does not depend on how the batch is split."""

    input_type = LossTokenLogprobs  # the policy hands us log-probs of the loss tokens

    def batch_fields(self) -> frozenset[str]:
        return frozenset({"advantages"})  # TrainBatch fields, checked at setup

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        mask = batch.loss_token_mask().to(logprobs)
        advantages = batch.advantages[:, : logprobs.shape[1]].to(logprobs)
        loss = -(advantages * logprobs * mask).sum() / global_count(global_valid_toks, logprobs)
        return loss, {"loss": float(loss)}


def reinforce_train(run: Run) -> dict[str, float]:
    g = run.config.grpo
    start_loop(run, lambda: validate(run), g.val_at_start)
    metrics: dict[str, float] = {}
    while run.step < run.total_steps:
        refit_if_stale(run)  # the generator samples from the policy's latest weights
        prompts = run.next_batch().repeat_interleave(g.num_generations_per_prompt)
        result = rollout_prompts(run, prompts)  # generate, and the environment scores
        batch = result.training_batch(run.tokenizer.pad_token_id)
        rewards = shaped_rewards(run, result)  # plus the overlong penalty, if configured
        advantages = (rewards - rewards.mean())[:, None] * batch.loss_mask
        batch = batch.replace(advantages=advantages)
        run.policy.prepare_for_training()
        metrics = reduce_step_metrics(run.policy.train(batch, run.loss_fn).metrics)
        metrics["reward_mean"] = float(result.rewards.mean())
        run.step += 1
        end_step(run, metrics, lambda: validate(run))  # log, validate, checkpoint when due
    run.logger.progress.stop()
    return metrics


def main(argv: list[str]) -> None:
    config = build_config(grpo, argv)  # GRPO's keys: grpo.*, policy.*, generation.*, env.*
    run = grpo.setup(config, loss_fn=ReinforceLoss())  # checks the fields the loss reads
    try:
        print("last step:", reinforce_train(run))
    finally:
        run.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
