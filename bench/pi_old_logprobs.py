"""Seconds of the pi_old pass of a GRPO batch: every position's log-probs, or the loss's only.

A step that takes more than one optimiser update from a batch (CISPO's and SAPO's runs, any
``train_global_batch_size`` below the batch) or a KL penalty first computes the log-probs of the
policy before the step (``grpo.steps.compute_logprobs``). Same model, same batch, same process,
no Ray (the worker called in-process, as ``bench/ppo_step.py`` does); the batch is that bench's
(groups of 8 rows sharing a 46-token prompt, responses of 8..32 tokens), ``--groups`` of them:

- every position (baseline): ``get_logprobs(batch)``, what the pass was before, and what a
  caller asking a policy for its log-probs gets: the output layer and a log-softmax over the
  whole vocabulary at every prompt and response position, each row's prompt run in full;
- the loss's tokens (ours): ``get_logprobs(batch, at_loss_tokens=True)``: the output layer only
  where the loss reads, and a group's prompt run once (``shared_prefix.py``).

Prints the largest difference of the two on the loss's tokens, each pass's seconds (median of
``--repeats``), then every position / loss's tokens last.

    uv run python bench/pi_old_logprobs.py --groups 16 --repeats 5
"""

from __future__ import annotations

import argparse

import torch
from ppo_step import GROUP, model_config, rollout_batch, timed

from rl_data.batch import TrainBatch
from rl_models.policy.dtensor_worker import DTensorPolicyWorker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    # As the main job with 16 prompts a step: bf16 autocast, micro-batches of 64 rows.
    policy = DTensorPolicyWorker(
        {
            "model": model_config(),
            "mixed_precision": "bfloat16",
            "train_global_batch_size": args.groups * GROUP,
            "train_micro_batch_size": 64,
            "dynamic_batching": {"enabled": False},
        }
    )
    batch, _ = rollout_batch(rows=args.groups * GROUP)

    def every_position() -> torch.Tensor:
        return policy.get_logprobs(batch)["logprobs"]

    def loss_tokens() -> torch.Tensor:
        return policy.get_logprobs(batch, at_loss_tokens=True)["logprobs"]

    wanted = TrainBatch.from_transport(batch).loss_token_mask() > 0
    difference = (every_position() - loss_tokens())[wanted].abs().max()
    baseline, ours = timed(every_position, args.repeats), timed(loss_tokens, args.repeats)
    rows, prompts = batch.size, batch.size // GROUP
    print(f"{rows} rows ({prompts} prompts x {GROUP}), {int(wanted.sum())} loss tokens")
    print(f"largest difference on the loss's tokens: {float(difference):.2e} (bf16 autocast)")
    print(f"every position: {baseline:.2f} s")
    print(f"the loss's tokens, prompts once: {ours:.2f} s")
    print(f"every position / loss's tokens: {baseline / ours:.2f}")


if __name__ == "__main__":
    main()
