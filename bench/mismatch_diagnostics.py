"""What the generator/trainer mismatch diagnostics cost a GRPO train step.

Same model, same data, same process, as ``bench/train_step.py`` builds them (its batch of
seed-fixed lognormal lengths, packed micro-batches). A GRPO step's loss logs the mismatch
diagnostics (``gen_train_kl_k1`` / ``_k3``, their maxima, ``token_mult_prob_error``) whenever
the batch carries the generator's log-probs, as every rollout batch does:

- without (baseline): the batch has no ``generation_logprobs``, so the loss computes none of
  them; the rest of the step is the same clipped policy gradient;
- with (ours): the same batch plus the generator's log-probs.

The two alternate, so that drift of the machine's speed falls on both. Prints the median
step time of each and, last, with / without (the target is at most 1.02).

    uv run python bench/mismatch_diagnostics.py
"""

from __future__ import annotations

import statistics
import time

import torch
from train_step import MODEL, SEQUENCES, TOKEN_BUDGET, make_batch

from rl_algorithms.losses.clipped_pg import ClippedPGLossFn
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

REPEATS = 10


def grpo_batch(with_generation_logprobs: bool):
    data = make_batch()
    gen = torch.Generator().manual_seed(1)
    rows = data["input_ids"].shape[0]
    data["advantages"] = torch.randn(rows, 1, generator=gen).expand_as(data["loss_mask"]).clone()
    if with_generation_logprobs:
        # Log-probs near the policy's own (a fresh model's are about -log V), a little off.
        noise = 0.05 * torch.randn(data["loss_mask"].shape, generator=gen)
        data["generation_logprobs"] = (-torch.log(torch.tensor(MODEL["vocab_size"])) + noise) * (
            data["loss_mask"]
        )
    return data


def main() -> None:
    torch.manual_seed(0)
    worker = DTensorPolicyWorker(
        {
            "model": {"hf_config": MODEL, "dtype": "float32"},
            "optimizer": {"name": "SGD", "kwargs": {"lr": 0.0}},  # the same weights every step
            "train_global_batch_size": SEQUENCES,
            "sequence_packing": {"enabled": True, "max_tokens_per_microbatch": TOKEN_BUDGET},
        }
    )
    loss = ClippedPGLossFn(pi_old_is_current=True)
    batches = {"without": grpo_batch(False), "with": grpo_batch(True)}
    metrics = {name: worker.train(b, loss).metrics for name, b in batches.items()}  # warm-up
    assert "gen_train_kl_k3" in metrics["with"] and "gen_train_kl_k3" not in metrics["without"]
    times: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(REPEATS):
        for name, batch in batches.items():
            start = time.perf_counter()
            worker.train(batch, loss)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{SEQUENCES} sequences, {int(batches['with']['input_lengths'].sum())} tokens, "
        f"{REPEATS} steps each, {torch.get_num_threads()} threads"
    )
    for name, seconds in median.items():
        low, high = min(times[name]), max(times[name])
        print(f"{name} diagnostics: {seconds:.3f} s a step (median; {low:.3f} to {high:.3f})")
    print(f"with / without diagnostics: {median['with'] / median['without']:.3f}x")


if __name__ == "__main__":
    main()
