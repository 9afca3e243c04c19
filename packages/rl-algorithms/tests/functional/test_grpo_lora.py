"""GRPO with LoRA on two DTensor ranks, sampling from vLLM on workers of its own: every refit
after the first sends exactly the adapters' bytes, and vLLM samples with them: its log-probs
agree with the trainer's to float32 rounding, while the trained policy is measurably away from
its reference (the KL penalty), which a generator without the adapters would have followed.
(LoRA with the HF generator, colocated, and a LoRA run's exact resume are in the PPO test.)
"""

import math

import pytest

from rl_algorithms import cli

from ..conftest import VLLM_CPU
from .conftest import LORA, check_adapter_refits, read_metrics, save_tiny_vllm_llama, write_config
from .test_grpo import grpo_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600)]


def test_grpo_lora_on_two_ranks_samples_from_vllm_with_the_adapters(tmp_path, assets):
    cfg = grpo_config(tmp_path, assets)
    cfg["policy"].update(
        model={"path": save_tiny_vllm_llama(tmp_path / "tiny", assets["tokenizer"])},
        lora=LORA,
        # One optimiser step per GRPO step: step 1's log-probs are all the bare base model's.
        train_global_batch_size=16,
        # The adapters start at B = 0; a larger step than full fine-tuning's moves them.
        optimizer={"name": "AdamW", "kwargs": {"lr": 1.0e-2}},
    )
    cfg["policy"]["model"]["dtype"] = "float32"
    cfg["generation"] = {
        "backend": "vllm",
        "colocated": False,
        "sampling": cfg["generation"]["sampling"],
        "vllm": dict(VLLM_CPU),
    }
    cfg["grpo"].update(max_num_steps=3, val_period=0)
    cfg["cluster"]["cpu_workers_per_node"] = 2
    assert cli.main(["grpo", "--config", write_config(tmp_path, cfg)]) == 0

    records = read_metrics(tmp_path / "logs")
    steps = {r["step"]: r for r in records if "train/loss" in r}
    assert sorted(steps) == [1, 2, 3]
    for step, r in steps.items():
        # vLLM applies the adapters the trainer has: their log-probs agree to float32.
        assert 1.0 <= r["train/token_mult_prob_error"] < 1.001, (step, r)
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]), r
    # B = 0 at the start: the policy is its reference, the bare base model, exactly; once
    # trained, the adapters move it away.
    assert abs(steps[1]["train/kl_penalty"]) < 1e-7, steps[1]
    for step in (2, 3):
        r = steps[step]
        # The control: were vLLM sampling from the bare base, its log-probs would be as far
        # from the trainer's as the base is from the policy (the KL penalty measures that).
        assert r["train/kl_penalty"] > 1e-5, r
        assert r["train/gen_train_kl_k3"] < 0.01 * r["train/kl_penalty"], r
    check_adapter_refits(records, tmp_path / "ckpt" / "step_3")
