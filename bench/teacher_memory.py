"""Peak resident memory of a distillation teacher's top-k scoring: chunked against whole logits.

The teacher reports, at every position, its ``k`` most likely next tokens and their log-probs
(``get_topk_logprobs``). From the output layer's input ``hidden [tokens, H]`` and its weight
``[V, H]``:

- **baseline** (full vocabulary, what a careful user writes): ``logits = hidden @ W.T``, then
  ``topk(logits) - logsumexp(logits)``: one ``[tokens, V]`` logits tensor (no second one for a
  whole log-softmax), plus ``logsumexp``'s own temporary;
- **ours** (``rl_models.policy.logprobs.chunked_topk_logprobs``): the same ``logprob_chunk_size``
  tokens at a time (the policy config's default, 1024): at most ``[chunk, V]`` logits exist.

Each variant runs in a fresh process (one cannot inherit another's peak), under ``no_grad`` like
the teacher, and reports the growth of its peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``) over its size once the inputs exist; both get the same inputs and
their results are checked equal. Shape: SmolLM2-135M's output layer (hidden 576, vocabulary
49152) over 4096 tokens, k = 64, float32; ``--vocab 151936`` for Qwen's vocabulary.

    uv run python bench/teacher_memory.py [--tokens 4096] [--vocab 49152] [--k 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from policy_memory import MB

from rl_models.policy.logprobs import chunked_topk_logprobs
from rl_models.resident_memory import peak_since, reset_peak

HIDDEN, CHUNK = 576, 1024


def inputs(tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    weight = torch.randn(vocab, HIDDEN, generator=gen) / HIDDEN**0.5
    return hidden, weight


@torch.no_grad()
def child(variant: str, tokens: int, vocab: int, k: int, out: str) -> None:
    torch.set_num_threads(1)
    hidden, weight = inputs(tokens, vocab)
    before = reset_peak()
    if variant == "full":
        logits = F.linear(hidden, weight)
        top, ids = logits.topk(k, dim=-1)
        values = top - torch.logsumexp(logits, dim=-1, keepdim=True)
    else:
        values, ids = chunked_topk_logprobs(hidden, weight, k, CHUNK)
    peak = peak_since(before)
    torch.save({"values": values, "ids": ids}, out)
    print(json.dumps({"peak": peak}), flush=True)


def run(variant: str, args: argparse.Namespace, folder: str) -> dict:
    out = os.path.join(folder, f"{variant}.pt")
    cmd = [sys.executable, __file__, "--child", variant, "--out", out]
    cmd += ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--k", str(args.k)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return {**json.loads(done.stdout.splitlines()[-1]), **torch.load(out)}


def main(args: argparse.Namespace) -> None:
    logits = args.tokens * args.vocab * 4
    print(f"{args.tokens} tokens, hidden {HIDDEN}, vocabulary {args.vocab}, k {args.k}, float32")
    print(f"one [tokens, vocab] float32 tensor: {logits / MB:.0f} MiB; chunk {CHUNK} tokens")
    with tempfile.TemporaryDirectory() as folder:
        full, ours = run("full", args, folder), run("chunked", args, folder)
    # The matmul of a chunk may round differently from the whole one's in float32, which can
    # swap near-tied tokens; the values must agree and the ids nearly everywhere.
    torch.testing.assert_close(ours["values"], full["values"], rtol=0, atol=1e-4)
    same = float((ours["ids"] == full["ids"]).double().mean())
    if same < 0.999:
        raise RuntimeError(f"only {same:.4%} of the top-k ids agree")
    print(f"results: values within 1e-4, {same:.4%} of ids equal")
    print(f"baseline (whole logits, topk - logsumexp): peak +{full['peak'] / MB:.0f} MiB")
    print(f"ours (chunked_topk_logprobs): peak +{ours['peak'] / MB:.0f} MiB")
    print(f"peak memory ratio baseline / ours: {full['peak'] / ours['peak']:.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--child", choices=["full", "chunked"])
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tokens, args.vocab, args.k, args.out)
    else:
        main(args)
