"""Rollouts: generate, let the environments answer, repeat until every sample is done.

A rollout starts from tokenised prompts (message logs whose last message ends with the
assistant header, as ``rl_data`` processors make them) and runs up to ``max_turns`` turns per
sample: the sample's log is flattened to token ids and generated from; the response becomes an
assistant message holding exactly the generated ids (``episodes``: token in, token out); the
sample's environment (by ``task_name``) scores it, and either ends the episode or answers with
an observation that is appended for the next turn. Rewards add up over turns (and so do their
components, when the environments keep them apart: see ``RolloutResult.reward_components``).

A sample also stops when its log reaches ``max_seq_len`` tokens (an observation that does not
fit is cut to the limit), or at the turn limit. It is *truncated* when a response was cut: by
``max_seq_len`` or by the generator's ``max_new_tokens`` (such a multi-turn sample still goes
on to its next turn: the environment answers whatever it got).

Two loops play the turns:

- ``run_rollouts``, the agent loop (``agent_loop.run_agent_loop``): every episode goes on as soon
  as its own generation and environment step return, never waiting for the batch's slowest
  tool; what the sync GRPO, PPO and distillation loops and evaluation use;
- ``run_lockstep_rollouts``: turn by turn, every active sample generated in one call and every
  environment stepped before any sample goes on (kept as the reference the agent loop is
  measured against: ``bench/agent_loop.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_algorithms.agent_loop import AgentLoopConfig, run_agent_loop
from rl_algorithms.environment_calls import (
    environment_metrics,
    step_environments,
    take_environment_counts,
)
from rl_algorithms.episodes import Episodes, generation_input
from rl_algorithms.rollout_result import RolloutResult
from rl_data.templates import ChatTemplate
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.interfaces import GenerationInterface

__all__ = [
    "AgentLoopConfig",
    "Episodes",
    "RolloutResult",
    "environment_metrics",
    "generation_input",
    "run_lockstep_rollouts",
    "run_rollouts",
    "step_environments",
    "take_environment_counts",
]


def run_rollouts(
    generation: GenerationInterface,
    batch: BatchedDataDict,
    tokenizer: Any,
    template: ChatTemplate,
    envs: Mapping[str, Any],
    *,
    max_seq_len: int,
    max_turns: int = 1,
    greedy: bool = False,
    expected_weight_version: int | None = None,
    with_env_metrics: bool = True,
    loop: AgentLoopConfig | None = None,
) -> RolloutResult:
    """Roll ``batch`` (``message_log``, ``extra_env_info``, ``task_name``) out to the end, each
    episode at its own pace (the agent loop; ``loop``: its concurrency and per-episode limits).

    ``envs`` maps task names to environment actors (or in-process environments).
    ``with_env_metrics``: the environments' metrics of this batch go into ``metrics`` (off:
    a caller that rolls out several batches asks once for all of them, see
    ``RolloutResult.environment_metrics``).
    """
    return run_agent_loop(
        generation,
        batch,
        tokenizer,
        template,
        envs,
        max_seq_len=max_seq_len,
        max_turns=max_turns,
        greedy=greedy,
        expected_weight_version=expected_weight_version,
        with_env_metrics=with_env_metrics,
        config=loop,
    )


def run_lockstep_rollouts(
    generation: GenerationInterface,
    batch: BatchedDataDict,
    tokenizer: Any,
    template: ChatTemplate,
    envs: Mapping[str, Any],
    *,
    max_seq_len: int,
    max_turns: int = 1,
    greedy: bool = False,
    expected_weight_version: int | None = None,
    with_env_metrics: bool = True,
) -> RolloutResult:
    """``run_rollouts`` turn by turn: each turn one generate call for every active sample, then
    every environment's step, before any sample goes on."""
    episodes = Episodes(batch, tokenizer, template, envs, max_seq_len)
    for turn in range(max_turns):
        if not episodes.active:
            break
        out = generation.generate(
            episodes.generation_input(),
            greedy=greedy,
            expected_weight_version=expected_weight_version,
        )
        episodes.play_turn(out, last=turn + 1 == max_turns)
    return episodes.result(with_env_metrics)
