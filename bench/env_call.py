"""An environment step as a Ray call: conversations sent with their tensors as numpy arrays,
versus sent as they are.

An environment runs as a Ray actor; each step call pickles the conversations it scores, with
a tensor or more per message (token ids, log-probs, loss mask). Baseline: the call a user
would write, ``env.step.remote(logs, metadata)``, the tensors pickled by torch (through their
storages' legacy ``torch.save`` format). Ours: the agent loop's call, the logs wrapped in
``ArrayPickled`` (``rl_data/array_pickling.py``). The actor's ``step`` reads every message's
tokens and returns an ``EnvironmentReturn`` (its own tensors travel as arrays in both
measurements: that part is the class's, not the call's). Shapes are a GRPO group's: 8
conversations a call sharing their prompt's tensors, single-turn (a prompt and an answer) or
``--turns`` tool turns.
Alternating rounds; the median of the rounds' ratios is printed last.

    uv run python bench/env_call.py [--turns 1] [--rounds 5] [--calls 40]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import ray
import torch

from rl_data.array_pickling import ArrayPickled
from rl_envs.interfaces import EnvironmentReturn


@ray.remote(num_cpus=0)
class Scorer:
    def step(self, logs: list, metadata: list) -> EnvironmentReturn:
        lengths = [sum(len(m["token_ids"]) for m in log) for log in logs]
        n = len(logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "ok"}] * n,
            metadata=[None] * n,
            next_stop_strings=[None] * n,
            rewards=torch.tensor(lengths, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=[None] * n,
        )


PROMPT = {"role": "user", "content": "What is 12 + 15?", "token_ids": torch.arange(40)}


def conversation(turns: int) -> list[dict]:
    log = [dict(PROMPT)]  # a group's conversations share the prompt's tensors, as in a run
    for _ in range(turns):
        log.append(
            {
                "role": "assistant",
                "content": "12 + 15 = 27",
                "token_ids": torch.arange(24),
                "token_loss_mask": torch.ones(24, dtype=torch.bool),
                "generation_logprobs": torch.zeros(24),
            }
        )
        log.append({"role": "tool", "content": "27", "token_ids": torch.arange(6)})
    return log[:-1] if turns else log  # the last turn is the answer being scored


def seconds_per_call(scorer, logs: list, metadata: list, calls: int, wrap: bool) -> float:
    ray.get(scorer.step.remote(ArrayPickled(logs) if wrap else logs, metadata))  # warm
    start = time.perf_counter()
    for _ in range(calls):
        ray.get(scorer.step.remote(ArrayPickled(logs) if wrap else logs, metadata))
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--conversations", type=int, default=8)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    scorer = Scorer.remote()
    logs = [conversation(args.turns) for _ in range(args.conversations)]
    metadata = [{"ground_truth": "27"}] * args.conversations
    plain_bytes = len(pickle.dumps(logs))
    print(f"bytes pickled: plain {plain_bytes}, as arrays {len(pickle.dumps(ArrayPickled(logs)))}")
    ratios = []
    for r in range(args.rounds):
        plain = seconds_per_call(scorer, logs, metadata, args.calls, wrap=False)
        ours = seconds_per_call(scorer, logs, metadata, args.calls, wrap=True)
        ratios.append(plain / ours)
        print(f"round {r + 1}: plain {plain * 1e3:.2f} ms/call, as arrays {ours * 1e3:.2f}")
    ray.shutdown()
    print(f"speedup (plain / as arrays), median of {args.rounds}: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
