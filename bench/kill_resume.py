"""SIGKILL a GRPO run at random points, resume it, and compare its final weights with an
uninterrupted run's: exact resume means every trial matches, bit for bit.

A tiny Llama (built from a config) on CPU in float32, the HF sampler, the arithmetic math
environment, ``STEPS`` steps with a checkpoint after each. Each trial starts a run, kills its
driver (``SIGKILL``, nothing runs on the way out) at a random step in one of four phases --
generation, training, refit, or mid-checkpoint-write (after the policy's weights are on disk and
before the checkpoint is complete) -- then runs the same command again, which resumes from the
latest complete checkpoint, and compares the last checkpoint's weights with the reference's.

    uv run python bench/kill_resume.py [--trials 10] [--seed 0]

Phases are found without hooks in the library: each run's driver is this file with
``--driver``, which wraps the GRPO loop's phase functions to print ``PHASE <name> <step>``
(flushed) as each begins; the bench kills after a random delay of up to ``--max-delay`` s from
the chosen line (at once for a checkpoint, whose line comes when the policy's files are
written and the rest of the checkpoint is not). The drivers attach to one Ray cluster that
this process starts (as a killed driver's actors are then reaped by Ray). Prints how many
trials matched last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STEPS = 4
PHASES = ("generation", "train", "refit", "checkpoint")
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


def make_tokenizer(root: Path) -> str:
    from rl_data.tokenizers import build_tokenizer

    corpus = [f"What is {a} + {b}? The answer is {a + b}." for a in range(10) for b in range(10)]
    path = root / "tokenizer"
    build_tokenizer(corpus * 3, vocab_size=400).save_pretrained(path)
    return str(path)


def run_config(run_dir: Path, tokenizer: str) -> dict:
    """What ``tests/functional/test_grpo.py`` runs, checkpointing after every step."""
    return {
        "policy": {
            "model": {"hf_config": TINY_LLAMA, "dtype": "float32"},
            "max_total_sequence_length": 128,
            "train_global_batch_size": 8,  # two optimiser steps per GRPO step
            "train_micro_batch_size": 4,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 1.0e-3}},
            "reference_policy": {"enabled": True},
        },
        "tokenizer": {"path": tokenizer},
        "generation": {
            "backend": "hf",
            "sampling": {"temperature": 0.8, "max_new_tokens": 12, "stop_strings": [" "]},
        },
        "loss_fn": {"reference_policy_kl_penalty": 0.01},
        "env": {"arithmetic": {"kind": "math", "config": {"num_workers": 1}}},
        "data": {
            "train": {"source": "arithmetic", "size": 40, "max_operand": 9},
            "max_seq_length": 64,
        },
        "grpo": {
            "num_prompts_per_step": 4,
            "num_generations_per_prompt": 4,
            "max_num_steps": STEPS,
            "val_period": 0,
            "reward_shaping": {
                "enabled": True,
                "max_response_length": 8,
                "overlong_buffer_length": 6,
            },
        },
        "logger": {"log_dir": str(run_dir / "logs"), "progress_bar": False},
        "checkpointing": {
            "checkpoint_dir": str(run_dir / "ckpt"),
            "save_period": 1,
            "keep_top_k": 2,
        },
        "cluster": {"ray_num_cpus": 4},
    }


# -- the driver: an ordinary `rl grpo` run that says which phase it is in ----------------------


def driver(config_path: str) -> int:
    """``rl grpo --config config_path``, printing ``PHASE <name> <step>`` as phases begin."""
    from rl_algorithms import cli
    from rl_algorithms.grpo import loop
    from rl_algorithms.utils import checkpoint

    def say(name: str, step: int) -> None:
        print(f"PHASE {name} {step}", flush=True)

    def wrap(module, name: str, phase: str) -> None:
        inner = getattr(module, name)

        def wrapped(run, *args, **kwargs):
            if phase != "refit" or run.generation.weight_version != run.policy.weight_version:
                say(phase, run.step + 1)
            return inner(run, *args, **kwargs)

        setattr(module, name, wrapped)

    wrap(loop, "refit_if_stale", "refit")
    wrap(loop, "generate_rollouts", "generation")
    wrap(loop, "train_on_rollouts", "train")
    save_policy = checkpoint.CheckpointManager.save

    def save(self, step, policy, **kwargs):
        class Announcing:  # says when the policy's files are written, mid-checkpoint
            def __getattr__(self, attr):
                return getattr(policy, attr)

            def save_checkpoint(self, path, training_state_dir=None):
                policy.save_checkpoint(path, training_state_dir)
                say("checkpoint", step)

        return save_policy(self, step, Announcing(), **kwargs)

    checkpoint.CheckpointManager.save = save
    return cli.main(["grpo", "--config", config_path])


# -- the bench -----------------------------------------------------------------------------


def start(config_path: Path, ray_address: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    return subprocess.Popen(
        [sys.executable, __file__, "--driver", str(config_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(config_path: Path, ray_address: str) -> None:
    proc = start(config_path, ray_address)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the run of {config_path} failed:\n{err[-3000:]}")


def kill_at(config_path: Path, ray_address: str, phase: str, step: int, delay: float) -> str:
    """Start the run and SIGKILL it ``delay`` s after it enters ``phase`` of ``step``; what
    happened, in words."""
    proc = start(config_path, ray_address)
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.append(proc.stderr.read()), daemon=True)
    reader.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == f"PHASE {phase} {step}":
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            # What it printed before it died: the last phase it had begun (a tiny model's
            # phases take milliseconds, so the run may have gone past the one aimed at).
            last = [x.split()[1:] for x in [line, *proc.stdout] if x.startswith("PHASE ")][-1]
            return f"killed {delay:.3f} s after {phase} {step} began, in {' '.join(last)}"
    proc.wait()
    reader.join(timeout=5)
    tail = "".join(stderr)[-2000:]
    raise RuntimeError(f"the run ended (rc {proc.returncode}) before {phase} {step}:\n{tail}")


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "ckpt" / f"step_{STEPS}" / "policy" / "model.safetensors")


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.03)
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        sys.exit(driver(args.driver))

    import ray
    import yaml

    from rl_distributed.virtual_cluster import init_ray

    init_ray(num_cpus=4, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    root = Path(tempfile.mkdtemp(prefix="kill-resume-"))
    rng = random.Random(args.seed)
    try:
        tokenizer = make_tokenizer(root)

        def config_for(name: str) -> Path:
            run_dir = root / name
            run_dir.mkdir()
            path = run_dir / "run.yaml"
            path.write_text(yaml.safe_dump(run_config(run_dir, tokenizer)), encoding="utf-8")
            return path

        start_time = time.monotonic()
        finish(config_for("straight"), address)
        reference = final_weights(root / "straight")
        print(f"uninterrupted run: {time.monotonic() - start_time:.0f} s", flush=True)

        matched = 0
        for trial in range(args.trials):
            phase = PHASES[trial % len(PHASES)]  # every phase, in turn
            # Refits begin at step 2 (step 1 samples the initial weights).
            step = rng.randint(2 if phase == "refit" else 1, STEPS)
            path = config_for(f"trial_{trial}")
            # Mid-checkpoint: at once, or the rest of the write (a few ms) is done before.
            delay = 0.0 if phase == "checkpoint" else rng.uniform(0, args.max_delay)
            what = kill_at(path, address, phase, step, delay)
            saved = sorted(p.name for p in (path.parent / "ckpt").glob("step_*"))
            if phase == "checkpoint":
                done = f"step_{step}" in saved
                what += " (after it was complete)" if done else " (mid-write: not complete)"
            finish(path, address)  # the same command again: resumes
            ok = same(final_weights(path.parent), reference)
            matched += ok
            print(
                json.dumps(
                    {"trial": trial, "what": what, "checkpoints_at_kill": saved, "match": ok}
                ),
                flush=True,
            )
            shutil.rmtree(path.parent, ignore_errors=True)
        print(f"{matched} of {args.trials} resumed runs matched the uninterrupted run's weights")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        ray.shutdown()


if __name__ == "__main__":
    main()
