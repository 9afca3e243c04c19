"""Episodes per minute: the per-sample agent loop against the lockstep loop, tools of varying speed.

    uv run python bench/agent_loop.py [--episodes 32] [--turns 8] [--repeats 3]

The same multi-turn episodes are rolled out both ways, with the same generator (``HfGeneration``:
a tiny Llama built from its config, one worker, greedy, so both loops sample the same tokens)
and the same tools: every episode's turn calls a tool whose latency, drawn once per (episode,
turn), varies 10x: a quick look-up (0.05 s) or, one call in five, a program that runs 0.5 s. The
tool environment runs the calls of one ``step`` concurrently (as a tool environment's process
pool does), so a lockstep turn waits for its slowest call, not for their sum.

What the agent loop can win on a fixed batch is the sum over turns of each turn's slowest call
(lockstep) against the slowest episode's own sum (per-sample): the more turns, and the rarer the
slow calls, the bigger the gap; a generate call's own time (paid per call, and the per-sample
loop makes more, smaller calls) narrows it. Hence 8 turns and a tiny generator.

* lockstep (``rollouts.run_lockstep_rollouts``, the loop before the agent loop): each turn one
  generate call for every active episode, then one environment step for all of them;
* per-sample (``rollouts.run_rollouts``, ``env_steps: per_episode``): every episode goes on as
  soon as its own tool returns; a generate call takes whichever episodes wait at that moment.

The two alternate ``--repeats`` times; the best run of each counts. Prints episodes per minute
of each, checks that both rolled out the same tokens, and prints the ratio per-sample/lockstep
last (target: at least 1.5).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rl_algorithms.agent_loop import AgentLoopConfig
from rl_algorithms.rollouts import run_lockstep_rollouts, run_rollouts
from rl_data.messages import tokenize_message_logs
from rl_data.templates import ChatTemplate, ChatTemplateConfig
from rl_data.tokenizers import build_tokenizer
from rl_distributed import RayVirtualCluster
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.virtual_cluster import init_ray
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn
from rl_models.generation.hf_generation import HfGeneration

FASTEST_TOOL_S, SLOWEST_TOOL_S = 0.05, 0.5
SLOW_CALLS = 0.2  # the fraction of calls that take SLOWEST_TOOL_S
NEW_TOKENS = 8
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
CORPUS = ["Look up the weather, run the program, search the notes: result ok error 0 1 2"] * 40


class TimedTools(EnvironmentInterface):
    """Each sample's tool call sleeps its (episode, turn) latency; the calls of one step run
    concurrently. The episode ends (reward 1) after ``turns`` tool calls."""

    def __init__(self, latencies: list[list[float]]) -> None:
        self.latencies = latencies
        self.pool = ThreadPoolExecutor(64)

    def _call(self, meta: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        time.sleep(self.latencies[meta["id"]][meta["turn"]])
        meta = {**meta, "turn": meta["turn"] + 1}
        return meta, meta["turn"] >= len(self.latencies[meta["id"]])

    def step(self, message_log_batch, metadata):
        results = list(self.pool.map(self._call, metadata))
        return EnvironmentReturn(
            observations=[
                [{"role": "tool", "content": f"result {m['turn']}", "tool_call_id": "0"}]
                for m, _ in results
            ],
            metadata=[m for m, _ in results],
            next_stop_strings=[None] * len(results),
            rewards=torch.tensor([float(done) for _, done in results]),
            terminateds=torch.tensor([done for _, done in results]),
            answers=[None] * len(results),
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


def episodes(tokenizer: Any, template: ChatTemplate, n: int) -> BatchedDataDict:
    logs = [[{"role": "user", "content": f"Run the program {k}"}] for k in range(n)]
    tokenize_message_logs(logs, tokenizer, template, add_generation_prompt=True)
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[{"id": k, "turn": 0} for k in range(n)],
        task_name=["tools"] * n,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rng = random.Random(0)
    latencies = [
        [SLOWEST_TOOL_S if rng.random() < SLOW_CALLS else FASTEST_TOOL_S for _ in range(args.turns)]
        for _ in range(args.episodes)
    ]
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    template = ChatTemplate.from_config(ChatTemplateConfig(), tokenizer)
    init_ray(num_cpus=2, log_to_driver=False)
    tok_dir = tempfile.mkdtemp()
    tokenizer.save_pretrained(tok_dir)
    generation = HfGeneration(
        RayVirtualCluster([1], use_gpus=False),
        {
            "backend": "hf",
            "colocated": False,
            "tokenizer": tok_dir,
            # Responses of a fixed length: the same work per turn in both loops.
            "sampling": {"max_new_tokens": NEW_TOKENS, "stop_token_ids": []},
        },
        model={"hf_config": {**TINY_LLAMA, "vocab_size": len(tokenizer)}, "dtype": "float32"},
    )
    batch = episodes(tokenizer, template, args.episodes)
    env = {"tools": TimedTools(latencies)}
    common = {"max_seq_len": 1024, "max_turns": args.turns, "greedy": True}
    loops = {
        "lockstep": lambda: run_lockstep_rollouts(
            generation, batch, tokenizer, template, env, **common
        ),
        "per-sample": lambda: run_rollouts(
            generation,
            batch,
            tokenizer,
            template,
            env,
            loop=AgentLoopConfig(env_steps="per_episode"),
            **common,
        ),
    }
    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    calls: dict[str, float] = {}
    latency: dict[str, float] = {}
    try:
        loops["lockstep"]()  # warm up the worker
        for _ in range(args.repeats):
            for name, roll in loops.items():
                start = time.perf_counter()
                result = roll()
                seconds = time.perf_counter() - start
                best[name] = min(best.get(name, seconds), seconds)
                tokens[name] = [torch.cat([m["token_ids"] for m in log]).tolist()
                                for log in result.message_logs]  # fmt: skip
                assert result.end_reasons == ["terminated"] * args.episodes, result.end_reasons
                calls[name] = result.timings.get("agent_loop/generation_calls", 0.0)
                latency[name] = result.timings.get("agent_loop/generation_latency_mean_s", 0.0)
    finally:
        generation.shutdown()
    same = tokens["lockstep"] == tokens["per-sample"]
    total_tool_s = sum(map(sum, latencies))
    print(
        f"{args.episodes} episodes x {args.turns} turns, tools {FASTEST_TOOL_S} s or "
        f"{SLOWEST_TOOL_S} s (1 call in {1 / SLOW_CALLS:.0f}) "
        f"({total_tool_s:.1f} s of tool time), {NEW_TOKENS} new tokens per turn"
    )
    for name, seconds in best.items():
        print(f"{name:>10}: {args.episodes / seconds * 60:8.1f} episodes/min ({seconds:.2f} s)")
    print(
        f"per-sample: {calls['per-sample']:.0f} generate calls, "
        f"{latency['per-sample']:.3f} s each on average"
    )
    print(f"same tokens rolled out by both loops: {same}")
    if not same:  # then the two did not do the same work, and their ratio means nothing
        raise SystemExit("the two loops rolled out different tokens: no ratio")
    print(f"per-sample / lockstep: {best['lockstep'] / best['per-sample']:.2f}x")


if __name__ == "__main__":
    main()
