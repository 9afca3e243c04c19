"""How close a GRPO step of the main recipe runs to this machine's limits, phase by phase.

    uv run python bench/limits.py [--steps 4] [KEY=VALUE ...]

The overrides change the recipe as on ``rl grpo``'s command line; the settings before this
bench's first optimisations were ``generation.static_kv_decode=false
policy.train_micro_batch_size=8``.

First the limits, measured in this process with torch's own threads (no vendor figure assumed):
read bandwidth (a ``sum`` over a tensor far larger than the caches: its bytes over its time;
decoding reads, it hardly writes) and the dense matmul peak in float32 and bfloat16 (square
``A @ B``, ``bench/mfu.py``'s measurement).

Then ``rl grpo``'s main recipe (``grpo_main.yaml``: SmolLM2-135M-Instruct, 4 prompts x 8
samples, up to 32 new tokens, a bf16 HF generator colocated with the float32 policy trained under
bf16 autocast) for ``--steps`` steps with validation and checkpoints off; the first step is
warm-up and is left out. Each timed step's phases against their limits:

- **generation**, a decode whose limit is the larger of two floors (a roofline):
  - reading: every decoding step reads all the generator's weights once (bf16: 2 bytes a
    parameter) and the KV cache of each running row. Bytes read = ``decode steps x weight
    bytes + KV bytes``, where decode steps = the step's longest response (rows finish and leave
    the batch; the weights are read as long as one row runs), and the KV bytes are summed over
    each response token's context (prompt + tokens so far); over the measured bandwidth;
  - arithmetic: 2 FLOPs per matmul parameter for every token fed through the model: each
    group's prompt once (its shared prefill; the output layer on the last position only) and
    every response token but each row's last (sampled, never fed back); over the matmul peak
    of the generator's dtype. With 32 rows decoding together on two cores this floor is the
    higher one: the machine computes a step's 32 tokens more slowly than it reads the weights.
  The fraction is that floor's seconds over the generation phase's seconds. Bytes and peak
  follow ``generation.dtype`` (``auto`` in the recipe: bf16 where native, else float32).
- **training**, compute-bound: model FLOPs of the train phase (forward and backward, 6 per
  matmul parameter per token: the decoder stack on a group's shared prompt once, as the
  trainer runs it with ``share_prompt_prefix``, and on every response token; the output layer
  on the response tokens only; attention's own FLOPs, ~2 % here, left out) over its seconds,
  as a fraction of the measured matmul peak of the policy's compute dtype (bf16 autocast in
  the recipe where native).
- refit and the rest are reported in seconds only.

Prints each fraction, generation's last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rl_models.modeling.precision import settle_mixed_precision

sys.path.insert(0, str(Path(__file__).parent))
from mfu import measured_matmul_tflops  # bench/ is not a package: found through sys.path


def memory_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s read by a sum over a large tensor (best of ``repeats``: the machine's capability,
    not its average load)."""
    src = torch.ones(megabytes * 2**20 // 4)
    src.sum()  # first touch: page faults out of the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - start)
    return src.numel() * 4 / best / 1e9


def main_recipe_steps(steps: int, out: Path, extra: list[str]) -> tuple[Any, list[dict]]:
    """The config and the timed steps' metrics of ``rl grpo``'s main recipe (the first step
    left out)."""
    from rl_algorithms import grpo
    from rl_algorithms.cli import build_config

    overrides = [
        f"grpo.max_num_steps={steps}",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        f"logger.log_dir={out}",
        *extra,
    ]
    config = build_config(grpo, overrides)
    grpo.main(config)
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return config, [r for r in rows if "train/step_seconds" in r][1:]


def model_sizes(config) -> dict[str, float]:
    """The policy's parameter counts (all; in the decoder stack's matmuls; in the output
    layer), KV elements per token, and a prompt's token count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_data.tokenizers import load_tokenizer
    from rl_models.model_files import materialize

    path = materialize(config.policy.model).path
    hf = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    tokenizer = load_tokenizer(config.tokenizer)
    prompt = [{"role": "user", "content": "What is 57 + 38? Answer with just the number."}]
    prompt_tokens = len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
    return {
        "parameters": total,
        # The embedding is a lookup, not a matmul (when tied, its weight is also the head).
        "body_parameters": total - (embedding if tied else embedding + head),
        "head_parameters": head,
        "kv_elements_per_token": 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim,
        "prompt_tokens": prompt_tokens,
    }


def dtype_of(name: str | None, default: str) -> torch.dtype:
    return getattr(torch, name or default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps run; the first is warm-up")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, KEY=VALUE")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is warm-up)")

    bandwidth = memory_bandwidth_gbs()
    # Best of three: one measurement on this shared machine once came out at half the others.
    peak = {
        dtype: max(measured_matmul_tflops(torch.device("cpu"), dtype, 2048) for _ in range(3))
        for dtype in (torch.float32, torch.bfloat16)
    }
    print(
        f"limits (torch threads {torch.get_num_threads()}): read bandwidth "
        f"{bandwidth:.1f} GB/s; matmul peak float32 {peak[torch.float32]:.3f} TFLOP/s, "
        f"bfloat16 {peak[torch.bfloat16]:.3f} TFLOP/s",
        flush=True,
    )

    out = Path(tempfile.mkdtemp(prefix="limits-"))
    config, rows = main_recipe_steps(args.steps, out, args.overrides)
    sizes = model_sizes(config)
    groups = config.grpo.num_prompts_per_step
    samples = groups * config.grpo.num_generations_per_prompt
    # The generator's dtype (None: the policy's weights') and the policy's compute dtype set
    # the bytes read per parameter and which matmul peak applies.
    use_gpus = config.cluster.use_gpus
    gen_dtype = dtype_of(config.generation.copy_dtype(use_gpus), config.policy.model.dtype)
    train_dtype = dtype_of(
        settle_mixed_precision(config.policy.mixed_precision, use_gpus),
        config.policy.model.dtype,
    )
    gen_peak = peak[gen_dtype if gen_dtype in peak else torch.float32]
    train_peak = peak[train_dtype if train_dtype in peak else torch.float32]
    width = gen_dtype.itemsize
    body, head = sizes["body_parameters"], sizes["head_parameters"]
    generation, training, floors = [], [], []
    for r in rows:
        completion = r["train/completion_tokens"]
        longest = r["train/max_generated_tokens"]
        # Each response token attends to its prompt and the tokens before it: on average the
        # prompt plus half the response, for every response token.
        mean_response = completion / samples
        kv = completion * (sizes["prompt_tokens"] + mean_response / 2)
        read = (longest * sizes["parameters"] + kv * sizes["kv_elements_per_token"]) * width
        # Through the generator: each group's prompt once (shared prefill; the output layer on
        # its last position only), then every response token but each row's last (sampled,
        # never fed back).
        fed = completion - samples
        gen_flops = 2 * (body * (groups * sizes["prompt_tokens"] + fed) + head * (groups + fed))
        reading = read / 1e9 / bandwidth
        computing = gen_flops / 1e12 / gen_peak
        floors.append((reading, computing))
        generation.append(max(reading, computing) / r["train/timing/generation"])
        # Training: the decoder stack on each group's prompt once (share_prompt_prefix) and
        # every response token; the output layer on the response tokens only.
        tokens = groups * sizes["prompt_tokens"] + completion
        flops = 6 * (body * tokens + head * completion)
        training.append(flops / r["train/timing/train"] / 1e12 / train_peak)
    phases = ("generation", "train", "refit", "logprobs")
    print(
        f"\n{len(rows)} timed steps of the main recipe; median seconds per phase: "
        + ", ".join(
            f"{p} {statistics.median(r[f'train/timing/{p}'] for r in rows):.2f}" for p in phases
        )
        + f"; step {statistics.median(r['train/step_seconds'] for r in rows):.2f}"
    )
    print(
        f"training: {statistics.median(training):.3f} of the {str(train_dtype)[6:]} matmul peak "
        "(model FLOPs/s)"
    )
    reading = statistics.median(f[0] for f in floors)
    computing = statistics.median(f[1] for f in floors)
    print(
        f"generation floors (median step): reading weights and KV {reading:.2f} s at the "
        f"measured bandwidth, matmuls {computing:.2f} s at the {str(gen_dtype)[6:]} peak"
    )
    print(
        f"generation: {statistics.median(generation):.3f} of its limit (the higher floor over "
        "the phase's seconds)"
    )


if __name__ == "__main__":
    main()
