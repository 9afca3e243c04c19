"""The generator/trainer mismatch KL in a real GRPO run, and its warning on a stale refit.

The synchronous loop (``grpo_train``) runs every step as it does in ``rl grpo``: refit, sampling
by the HF generator in bfloat16, the sliding puzzle's rewards with DAPO's overlong shaping (the
random responses' lengths differ, so the advantages are not all zero and the policy moves), the
float32 trainer's log-probs and its clipped policy-gradient step, whose loss reports the KL
between the two (``gen_train_kl_k3``), then ``warn_on_mismatch``. The policy and the generator
are the real workers in this process (``in_process.py``: no Ray), refit moves the weights through
their export and load methods.

One refit is skipped on purpose: the generator's version is stamped but its weights stay those
of the step before (a refit that failed silently), while the trainer took an AdamW step with a
large learning rate in between. The KL of that step is orders of magnitude above the healthy
steps', the warning fires once, and the count goes on.
"""

from __future__ import annotations

import json
import warnings

import torch

import rl_models.generation.refit as refit_module
from rl_algorithms import grpo
from rl_algorithms.grpo.loop import grpo_train
from rl_algorithms.grpo.steps import make_loss
from rl_algorithms.run import Run
from rl_algorithms.utils.logger import Logger
from rl_data.collate import rl_collate
from rl_data.loader import StatefulDataLoader
from rl_envs.sliding_puzzle import SlidingPuzzleEnvironment

from .conftest import TINY_LLAMA
from .in_process import in_process_generation, in_process_policy, in_process_refit
from .test_rollouts import puzzle_datums

STEPS = 4
SKIPPED_REFIT = 3  # the refit before this step (1-based) delivers no weights
MAX_NEW_TOKENS = 8


def mismatch_run(tokenizer, template, tmp_path) -> Run:
    config = grpo.MasterConfig.model_validate(
        {
            "policy": {
                "model": {
                    "hf_config": {**TINY_LLAMA, "vocab_size": len(tokenizer)},
                    "dtype": "float32",
                },
                "train_global_batch_size": 8,
                "train_micro_batch_size": 8,
                "max_total_sequence_length": 512,
                "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-1}},
            },
            "tokenizer": {"path": str(tmp_path)},
            "generation": {
                "backend": "hf",
                "dtype": "bfloat16",
                # A third of the vocabulary ends a response: lengths vary within a group.
                "sampling": {
                    "max_new_tokens": MAX_NEW_TOKENS,
                    "stop_token_ids": list(range(len(tokenizer) // 3)),
                },
            },
            "loss_fn": {"reference_policy_kl_penalty": 0.0},
            "env": {"puzzle": {"kind": "sliding_puzzle"}},
            "data": {"train": {"source": "arithmetic"}},
            "grpo": {
                "num_prompts_per_step": 2,
                "num_generations_per_prompt": 4,
                "max_num_steps": STEPS,
                "reward_shaping": {
                    "enabled": True,
                    "max_response_length": MAX_NEW_TOKENS,
                    "overlong_buffer_length": MAX_NEW_TOKENS,
                },
            },
            "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
        }
    )
    datums = puzzle_datums(tokenizer, template, samples=(0, 1) * STEPS)
    loader = StatefulDataLoader(
        datums, 2, lambda b: rl_collate(b, tokenizer.pad_token_id), shuffle=False
    )
    log: list = []
    plan = config.generation.plan(config.policy.model, config.cluster.use_gpus)
    run = Run(
        name="grpo",
        config=config,
        policy=in_process_policy(config.policy.worker_config(), "policy", log),
        generation=in_process_generation(plan.config, plan.model, log),
        clusters=[],
        envs={"puzzle": SlidingPuzzleEnvironment()},
        tokenizer=tokenizer,
        template=template,
        train_loader=loader,
        val_loader=None,
        logger=Logger(config.logger),
        checkpointer=None,
        total_steps=STEPS,
        loss_fn=make_loss(config),
    )
    return run


def test_a_skipped_refit_makes_the_mismatch_kl_jump_and_warns_once(
    tokenizer, template, tmp_path, monkeypatch
):
    run = mismatch_run(tokenizer, template, tmp_path)
    refits: list[str | None] = []

    def refit(policy, generation, **kwargs):
        refits.append(kwargs.get("dtype"))
        deliver = run.step + 1 != SKIPPED_REFIT  # (run.step: the steps done)
        return in_process_refit(policy, generation, deliver=deliver, **kwargs)

    monkeypatch.setattr(refit_module, "refit", refit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo_train(run)
    run.logger.close()
    logged = [
        json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    kl = [m["train/gen_train_kl_k3"] for m in logged]
    healthy = kl[: SKIPPED_REFIT - 1] + kl[SKIPPED_REFIT:]
    threshold = run.config.grpo.mismatch_kl_warn_threshold

    # What is compared: a bfloat16 generator, its weights cast on every refit, and a float32
    # trainer.
    assert refits == ["bfloat16"] * (STEPS - 1)
    assert {p.dtype for p in run.generation.worker_group.worker.model.parameters()} == {
        torch.bfloat16
    }
    assert {p.dtype for p in run.policy.worker_group.worker.model.parameters()} == {torch.float32}
    # Fresh weights: the rounding to bfloat16 alone shows, never 0 and far below the threshold
    # (its growth over the steps follows the logits' growth as the policy sharpens).
    assert all(0 < v < threshold / 10 for v in healthy), kl
    assert all(m["train/gen_train_kl_k1_max"] > 0 for m in logged)
    # Stale weights: the step the policy took in between shows, by orders of magnitude.
    assert kl[SKIPPED_REFIT - 1] > threshold
    assert kl[SKIPPED_REFIT - 1] > 1000 * max(kl[: SKIPPED_REFIT - 1])
    # One warning, naming the step; the count logged from then on.
    messages = [str(w.message) for w in caught if "gen_train_kl_k3" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith(f"step {SKIPPED_REFIT}:")
    counts = [m["train/mismatch_kl_warn_steps"] for m in logged]
    assert counts == [0.0] * (SKIPPED_REFIT - 1) + [1.0] * (STEPS - SKIPPED_REFIT + 1)
