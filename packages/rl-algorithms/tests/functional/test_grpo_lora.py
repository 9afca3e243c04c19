"""GRPO with LoRA on two DTensor ranks, sampling from vLLM on workers of its own (three steps)
and from the HF generator colocated with the policy (two steps): every refit after the first
sends exactly the adapters' bytes, and the generator samples with them: its log-probs agree with
the trainer's to float32 rounding, while the trained policy is measurably away from its
reference (the KL penalty), which a generator without the adapters would have followed.
(A LoRA run's exact resume is in the PPO test.)
"""

import math

import pytest

from rl_algorithms import cli

from ..conftest import VLLM_CPU
from .conftest import (
    LORA,
    check_adapter_refits,
    check_generator_agrees,
    read_metrics,
    save_tiny_vllm_llama,
    write_config,
)
from .test_grpo import grpo_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, assets) -> str:
    """One tiny Llama on disk for both generators (vLLM loads from a directory)."""
    return save_tiny_vllm_llama(tmp_path_factory.mktemp("tiny"), assets["tokenizer"])


@pytest.mark.parametrize(
    ("backend", "steps"),
    [("vllm", 3), ("hf", 2)],
    ids=["vllm-own-workers", "hf-colocated"],
)
def test_grpo_lora_on_two_ranks_samples_with_the_adapters(
    tmp_path, assets, tiny_model, backend, steps
):
    cfg = grpo_config(tmp_path, assets)
    cfg["policy"].update(
        model={"path": tiny_model, "dtype": "float32"},
        lora=LORA,
        # One optimiser step per GRPO step: step 1's log-probs are all the bare base model's.
        train_global_batch_size=16,
        # The adapters start at B = 0; a larger step than full fine-tuning's moves them.
        optimizer={"name": "AdamW", "kwargs": {"lr": 1.0e-2}},
    )
    sampling = cfg["generation"]["sampling"]
    if backend == "vllm":
        cfg["generation"] = {
            "backend": "vllm",
            "colocated": False,
            "sampling": sampling,
            "vllm": dict(VLLM_CPU),
        }
    else:  # one HF generation worker on each of the policy's two bundles
        cfg["generation"] = {"backend": "hf", "colocated": True, "sampling": sampling}
    cfg["grpo"].update(max_num_steps=steps, val_period=0)
    cfg["checkpointing"]["save_period"] = steps
    cfg["cluster"]["cpu_workers_per_node"] = 2
    assert cli.main(["grpo", "--config", write_config(tmp_path, cfg)]) == 0

    records = read_metrics(tmp_path / "logs")
    by_step = {r["step"]: r for r in records if "train/loss" in r}
    assert sorted(by_step) == list(range(1, steps + 1))
    for step, r in by_step.items():
        # The generator applies the adapters the trainer has: their log-probs agree to float32.
        assert 1.0 <= r["train/token_mult_prob_error"] < 1.001, (step, r)
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]), r
    # B = 0 at the start: the policy is its reference, the bare base model, exactly; once
    # trained, the adapters move it away.
    assert abs(by_step[1]["train/kl_penalty"]) < 1e-7, by_step[1]
    for step in range(2, steps + 1):
        r = by_step[step]
        # The control: were the generator sampling from the bare base, its log-probs would be
        # as far from the trainer's as the base is from the policy (the KL penalty measures it).
        assert r["train/kl_penalty"] > 1e-5, r
        assert r["train/gen_train_kl_k3"] < 0.01 * r["train/kl_penalty"], r
    check_adapter_refits(records, tmp_path / "ckpt" / f"step_{steps}")
    if backend == "hf":  # the trainer's own numerics: agreement to rounding, not just close
        check_generator_agrees(records)
