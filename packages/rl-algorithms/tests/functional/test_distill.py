"""`rl distill` end to end on tiny models: the student moves towards a frozen teacher on its
own samples (the top-k KL falls), both estimators run through `rl distill` (the second with a
LoRA student on two ranks whose refits send only its adapters); a teacher whose vocabulary
differs is refused before any worker starts."""

import math

import pytest

from rl_algorithms import cli

from .conftest import LORA, TINY_LLAMA, check_adapter_refits, read_metrics, series, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600)]
STEPS = 4
LR = {"topk": 1.0e-3, "sampled_token": 3.0e-4}


def peaked_teacher(tmp_path, assets) -> str:
    """A wider tiny Llama on disk (with the student's tokenizer) whose output layer is scaled
    up, so that its next-token distributions are peaked, far from a random student's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf = {**TINY_LLAMA, "hidden_size": 128}
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    path = tmp_path / "teacher"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(assets["tokenizer"]).save_pretrained(path)
    return str(path)


def distill_config(tmp_path, assets, estimator: str) -> dict:
    """A random tiny student and a peaked tiny teacher; a high learning rate so that a few
    steps visibly close the gap."""
    return {
        "policy": {
            "model": {"hf_config": TINY_LLAMA, "dtype": "float32"},
            "max_total_sequence_length": 128,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 4,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": LR[estimator]}},
        },
        "teacher": {"model": {"path": peaked_teacher(tmp_path, assets), "dtype": "float32"}},
        "tokenizer": {"path": assets["tokenizer"]},
        "generation": {"backend": "hf", "sampling": {"temperature": 1.0, "max_new_tokens": 12}},
        "loss_fn": {"estimator": estimator, "kl_type": "mixed"},
        "env": {"arithmetic": {"kind": "math", "config": {"num_workers": 1}}},
        "data": {
            "train": {"source": "arithmetic", "size": 60, "max_operand": 9},
            "validation_fraction": 0.1,
            "max_seq_length": 64,
        },
        "distillation": {
            "num_prompts_per_step": 8,
            "max_num_steps": STEPS,
            "topk_logits_k": 8,
            "val_period": STEPS,
            "val_batch_size": 4,
            "max_val_samples": 4,
        },
        "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
        "checkpointing": {"checkpoint_dir": str(tmp_path / "ckpt"), "save_period": STEPS},
        "cluster": {"ray_num_cpus": 4},
    }


@pytest.mark.parametrize("estimator", ["topk", "sampled_token"])
def test_the_student_closes_its_gap_to_the_teacher(tmp_path, assets, estimator):
    config = distill_config(tmp_path, assets, estimator)
    if estimator == "sampled_token":
        # Both placements in the one pair of runs: this teacher gets a cluster of its own.
        config["teacher"]["colocated"] = False
        # And a LoRA student on two DTensor ranks (each exports its shard of the adapters), its
        # adapters on a higher learning rate (B starts at 0).
        config["policy"].update(lora=LORA, optimizer={"name": "AdamW", "kwargs": {"lr": 1e-2}})
        config["cluster"]["cpu_workers_per_node"] = 2
    cfg = write_config(tmp_path, config)
    assert cli.main(["distill", "--config", cfg]) == 0
    records = read_metrics(tmp_path / "logs")
    kl = series(records, "train/kl")
    assert len(kl) == STEPS and all(math.isfinite(v) for v in kl), kl
    if estimator == "topk":
        # The whole top-k distribution per token: a few steps close much of the gap. (The
        # sampled-token estimator, one REINFORCE sample per token with no baseline, is too
        # noisy from a random student this far from its teacher to fall within 4 steps; its
        # gradient is checked exactly in tests/losses/test_distillation.py.)
        assert (kl[-1] + kl[-2]) / 2 < 0.95 * kl[0], kl
    teacher_key = "train/teacher_topk_mass" if estimator == "topk" else "train/teacher_logprob_mean"
    assert len(series(records, teacher_key)) == STEPS
    assert series(records, "val/accuracy")
    assert (tmp_path / "ckpt" / f"step_{STEPS}" / "policy" / "model.safetensors").is_file()
    if estimator == "sampled_token":
        check_adapter_refits(records, tmp_path / "ckpt" / f"step_{STEPS}")


def test_a_teacher_with_another_vocabulary_is_refused_before_ray(tmp_path, assets, capsys):
    from rl_data.tokenizers import build_tokenizer

    other = tmp_path / "other-tokenizer"
    build_tokenizer(
        ["completely different words for another vocabulary"] * 20, 300
    ).save_pretrained(other)
    config = distill_config(tmp_path, assets, "topk")
    config["teacher"]["tokenizer"] = {"path": str(other)}
    cfg = write_config(tmp_path, config)
    with pytest.raises(ValueError, match=r"differ: token id \d+ is"):
        cli.main(["distill", "--config", cfg])
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()
