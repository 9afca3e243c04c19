"""Rollouts: generate, let the environments answer, repeat until every sample is done.

A rollout starts from tokenised prompts (message logs whose last message ends with the
assistant header, as ``rl_data`` processors make them) and runs up to ``max_turns`` turns:

1. every *active* sample's log is flattened to token ids and generated from (one batched call);
2. the response becomes an assistant message whose ``token_ids`` are exactly the generated ids
   (with the generator's per-token ``generation_logprobs``), never re-tokenised text;
3. samples are grouped by ``task_name`` and each environment actor steps its group in one
   batched call (all environments at once);
4. rewards add up; a terminated sample stops; the others get the observation appended,
   tokenised on its own (``rl_data.messages.tokenize_message_logs``), and go on.

A sample also stops when its log reaches ``max_seq_len`` tokens (an observation that does not
fit is cut to the limit), or at the turn limit. It is *truncated* when a response was cut: by
``max_seq_len`` or by the generator's ``max_new_tokens`` (such a multi-turn sample still goes
on to its next turn: the environment answers whatever it got).

The template's text for an assistant turn may continue after the generated stop token (ChatML
writes ``<|im_end|>\\n``); that remainder is tokenised and appended to the assistant message with
``token_loss_mask`` 0, so later turns see the conversation exactly as the template renders it
while the loss and the importance ratios cover only sampled tokens.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from rl_data.collate import flatten_message_logs
from rl_data.messages import tokenize_message_logs, truncate_message_log
from rl_data.templates import ChatTemplate
from rl_data.tokenizers import encode_texts
from rl_data.types import MessageLog
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.interfaces import EnvironmentReturn
from rl_models.generation.interfaces import GenerationInterface


@dataclass
class RolloutResult:
    """What a rollout gives back, one entry per sample, in the input's order."""

    message_logs: list[MessageLog]
    rewards: torch.Tensor  # float32 [N], summed over turns
    truncated: torch.Tensor  # bool [N]: cut by max_seq_len or max_new_tokens
    terminated: torch.Tensor  # bool [N]: the environment ended the episode
    turns: torch.Tensor  # int64 [N]: generation turns taken
    env_metadata: list[Any]
    answers: list[str | None]  # the last answer each environment extracted
    metrics: dict[str, float] = field(default_factory=dict)

    def training_batch(self, pad_token_id: int) -> BatchedDataDict:
        """Right-padded ``input_ids`` with ``token_mask`` on sampled tokens only and the
        generator's ``generation_logprobs`` aligned to them (0 elsewhere)."""
        # Only tokens carrying a ``token_loss_mask`` (the sampled ones) are trained on: an
        # assistant turn that came with the prompt (few-shot) was never sampled.
        flat = flatten_message_logs(self.message_logs, pad_token_id, loss_roles=())
        width = flat["input_ids"].shape[1]
        gen_lp = torch.zeros(len(self.message_logs), width, dtype=torch.float32)
        for b, log in enumerate(self.message_logs):
            pieces = [
                m["generation_logprobs"].float()
                if "generation_logprobs" in m
                else torch.zeros(len(m["token_ids"]))
                for m in log
            ]
            row = torch.cat(pieces)
            gen_lp[b, : len(row)] = row
        return BatchedDataDict(
            input_ids=flat["input_ids"],
            input_lengths=flat["input_lengths"],
            token_mask=flat["loss_mask"].to(torch.float32),
            generation_logprobs=gen_lp,
        )


def _call_env(env: Any, logs: list[MessageLog], metadata: list[Any]) -> Any:
    """A Ray actor's ``step.remote`` future, or an in-process environment's result."""
    step = env.step
    return step.remote(logs, metadata) if hasattr(step, "remote") else step(logs, metadata)


def _resolve(result: Any) -> EnvironmentReturn:
    return ray.get(result) if isinstance(result, ray.ObjectRef) else result


def step_environments(
    envs: Mapping[str, Any],
    logs: Sequence[MessageLog],
    metadata: Sequence[Any],
    task_names: Sequence[str],
) -> list[tuple[dict, dict | None, list[str] | None, float, bool, str | None]]:
    """One environment step per sample, batched per environment and run concurrently.

    Returns per sample ``(observation, metadata, next_stop_strings, reward, terminated,
    answer)``, in the order of ``logs``.
    """
    by_task: dict[str, list[int]] = defaultdict(list)
    for i, task in enumerate(task_names):
        if task not in envs:
            raise KeyError(
                f"sample {i} has task_name {task!r} but no environment is configured for it "
                f"(env: {sorted(envs)})"
            )
        by_task[task].append(i)
    pending = {
        task: _call_env(envs[task], [logs[i] for i in rows], [metadata[i] for i in rows])
        for task, rows in by_task.items()
    }
    out: list[Any] = [None] * len(logs)
    for task, rows in by_task.items():
        ret = _resolve(pending[task])
        if len(ret.rewards) != len(rows):
            raise RuntimeError(
                f"environment {task!r} returned {len(ret.rewards)} rewards for {len(rows)} samples"
            )
        for j, i in enumerate(rows):
            out[i] = (
                ret.observations[j],
                ret.metadata[j],
                ret.next_stop_strings[j],
                float(ret.rewards[j]),
                bool(ret.terminateds[j]),
                ret.answers[j],
            )
    return out


def _assistant_message(
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    tokenizer: Any,
    template: ChatTemplate,
    log: MessageLog,
    room: int,
) -> dict[str, Any]:
    """The generated turn as a message: the sampled ids as they are, plus the template's
    closing text (if any, and if it fits in ``room`` tokens) as tokens out of the loss."""
    content = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "token_ids": ids,
        "token_loss_mask": torch.ones_like(ids),
        "generation_logprobs": logprobs,
    }
    generated = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    full = template.message_texts([*log, message], start=len(log))[0]
    if full.startswith(generated) and len(full) > len(generated):
        tail = torch.tensor(encode_texts(tokenizer, [full[len(generated) :]])[0], dtype=torch.long)
        if len(ids) + len(tail) > room:
            return message
        message["token_ids"] = torch.cat([ids, tail])
        message["token_loss_mask"] = torch.cat([message["token_loss_mask"], torch.zeros_like(tail)])
        message["generation_logprobs"] = torch.cat([logprobs, torch.zeros(len(tail))])
    return message


def _length(log: MessageLog) -> int:
    return sum(len(m["token_ids"]) for m in log)


def _generation_input(
    logs: Sequence[MessageLog], stops: Sequence[Any], pad_id: int
) -> BatchedDataDict:
    rows = [torch.cat([m["token_ids"] for m in log]) for log in logs]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    ids = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, stop_strings=list(stops))


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
) -> RolloutResult:
    """Roll ``batch`` (``message_log``, ``extra_env_info``, ``task_name``) out to the end.

    ``envs`` maps task names to environment actors (or in-process environments). The input's
    message logs are copied, never changed.
    """
    logs: list[MessageLog] = [[dict(m) for m in log] for log in batch["message_log"]]  # type: ignore[misc]
    n = len(logs)
    metadata = [copy.deepcopy(m) for m in batch["extra_env_info"]]
    tasks = list(batch["task_name"])
    pad_id = tokenizer.pad_token_id
    rewards = torch.zeros(n, dtype=torch.float32)
    truncated = torch.zeros(n, dtype=torch.bool)
    out_of_room = torch.zeros(n, dtype=torch.bool)  # reached max_seq_len: stops
    terminated = torch.zeros(n, dtype=torch.bool)
    turns = torch.zeros(n, dtype=torch.long)
    answers: list[str | None] = [None] * n
    stops: list[Any] = [None] * n
    metrics: dict[str, float] = {}
    for i in range(n):
        out_of_room[i] = truncated[i] = _length(logs[i]) >= max_seq_len
    active = [i for i in range(n) if not out_of_room[i]]

    for turn in range(max_turns):
        if not active:
            break
        out = generation.generate(
            _generation_input([logs[i] for i in active], [stops[i] for i in active], pad_id),
            greedy=greedy,
            expected_weight_version=expected_weight_version,
        )
        gen_tokens = 0
        for j, i in enumerate(active):
            start = _length(logs[i])
            length = int(out["generation_lengths"][j])
            room = max_seq_len - start
            if length >= room:
                out_of_room[i] = True
            if length > room or bool(out["truncated"][j]):
                truncated[i] = True
            length = min(length, room)
            ids = out["output_ids"][j, start : start + length].to(torch.long)
            lps = out["logprobs"][j, start : start + length].to(torch.float32)
            logs[i].append(_assistant_message(ids, lps, tokenizer, template, logs[i], room))  # type: ignore[arg-type]
            turns[i] += 1
            gen_tokens += length
        # Every sample that generated is scored, truncated ones too (their reward says so).
        results = step_environments(
            envs,
            [logs[i] for i in active],
            [metadata[i] for i in active],
            [tasks[i] for i in active],
        )
        turn_rewards = []
        for i, (_obs, meta, stop, reward, done, answer) in zip(active, results, strict=True):
            rewards[i] += reward
            turn_rewards.append(reward)
            metadata[i], stops[i], answers[i] = meta, stop, answer
            terminated[i] = done
        metrics[f"turn_{turn}/active_samples"] = float(len(active))
        metrics[f"turn_{turn}/mean_generation_length"] = gen_tokens / len(active)
        metrics[f"turn_{turn}/reward_mean"] = sum(turn_rewards) / len(turn_rewards)

        going = [i for i in active if not terminated[i] and not out_of_room[i]]
        if turn + 1 < max_turns and going:
            for i, (obs, *_rest) in zip(active, results, strict=True):
                if i in going:
                    logs[i].append({"role": obs["role"], "content": obs["content"]})  # type: ignore[typeddict-item]
            tokenize_message_logs(
                [logs[i] for i in going], tokenizer, template, add_generation_prompt=True
            )
            for i in going:
                if _length(logs[i]) >= max_seq_len:  # the episode is cut short
                    out_of_room[i] = truncated[i] = True
                    # and the observation cut to the limit: no row may outgrow max_seq_len
                    logs[i][:] = truncate_message_log(logs[i], max_seq_len)
        active = [i for i in going if not out_of_room[i]]

    lengths = [
        sum(int(m["token_loss_mask"].sum()) for m in log if "token_loss_mask" in m) for log in logs
    ]
    metrics.update(
        {
            "mean_turns": float(turns.double().mean()),
            "truncated_fraction": float(truncated.double().mean()),
            "terminated_fraction": float(terminated.double().mean()),
            "mean_generated_tokens": sum(lengths) / n,
            "completion_tokens": float(sum(lengths)),
            "reward_mean": float(rewards.double().mean()),
        }
    )
    return RolloutResult(logs, rewards, truncated, terminated, turns, metadata, answers, metrics)
