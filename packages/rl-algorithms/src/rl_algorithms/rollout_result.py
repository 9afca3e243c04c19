"""What a rollout gives back: ``RolloutResult``, one entry per sample."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_algorithms.environment_calls import environment_metrics
from rl_data.array_pickling import reduce_with_arrays, shallow_copy
from rl_data.batch import TrainBatch
from rl_data.collate import flatten_message_logs
from rl_data.types import MessageLog
from rl_envs.interfaces import RewardComponents

# The end reasons of an agent program's failed episodes start with this
# (``agent_programs.trajectories``: it raised, hung past its deadline, never called the
# endpoint, ...): what they hold says nothing of what the policy would do, so they stay out of
# the loss, as an environment's timeout does.
AGENT_FAILED_PREFIX = "agent_failed/"
# End reasons of episodes whose reward carries no signal (``episodes.END_REASONS``): the
# environment did not answer in time, or answered without a score.
ENV_TIMEOUT = "env_timeout"
UNSCORED = "unscored"
NO_SIGNAL = (ENV_TIMEOUT, UNSCORED)


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
    # bool [N]: rows that only fill a batch up to its size (dynamic sampling's groups without
    # a signal); they stay out of the loss.
    filler: torch.Tensor | None = None
    # Each sample's task (its environment) and dataset row (the G samples of a prompt share
    # it; None when the data has no ``idx``): what ``environment_metrics`` needs afterwards.
    task_names: list[str] = field(default_factory=list)
    group_ids: list[int] | None = None
    # [N, K]: the separate rewards that ``rewards`` is the weighted sum of, summed over turns
    # like it, for GDPO. None unless every sample that met an environment got them, with the
    # same names and weights (a sample too long to generate from has reward 0 and components 0).
    reward_components: RewardComponents | None = None
    # How each episode ended (``episodes.END_REASONS``: terminated by its environment, or at
    # a limit) and the tool calls it made (``role: tool`` replies it got); empty / None when
    # the rows were not rolled out here.
    end_reasons: list[str] = field(default_factory=list)
    tool_calls: torch.Tensor | None = None  # int64 [N]
    # What depends on timing, kept out of ``metrics`` (which a rerun reproduces bit for bit):
    # seconds per episode, per generate call and per environment step, the calls made.
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.filler is None:
            self.filler = torch.zeros(len(self.message_logs), dtype=torch.bool)

    def __reduce__(self) -> tuple[Any, ...]:
        # From the async collector to the trainer, a tensor or more per message: as arrays.
        return reduce_with_arrays(self)

    def __copy__(self) -> RolloutResult:
        return shallow_copy(self)

    def sample_mask(self) -> torch.Tensor:
        """float32 ``[N]``: 1 for the rows a loss may train on. Out of it: fillers, and
        episodes whose environment did not answer in time (``env_timeout``) or could not score
        them (``unscored``), or whose agent program failed (``agent_failed/...``): their reward
        says nothing of what the policy did."""
        timed_out = torch.tensor(
            [r in NO_SIGNAL or r.startswith(AGENT_FAILED_PREFIX) for r in self.end_reasons],
            dtype=torch.bool,
        )
        out = self.filler | timed_out if self.end_reasons else self.filler
        return (~out).to(torch.float32)

    def environment_metrics(self, envs: Mapping[str, Any]) -> dict[str, float]:
        """The environments' metrics of these samples (``env/<task>/<name>``); a call to each
        environment, which also hands out (and resets) the counts it kept since its last."""
        return environment_metrics(envs, self.task_names, self.rewards, self.group_ids)

    def samples(self, n: int) -> list[dict[str, Any]]:
        """The first ``n`` samples as text, to look at: ``prompt`` (the messages before the
        first generated turn), ``completion`` (the rest: one turn, or a whole multi-turn
        exchange with each message's role), ``reward`` and, where the environment gave one,
        ``answer`` (what it extracted and scored; an LLM judge's verdict)."""
        out = []
        answers = self.answers or [None] * len(self.message_logs)
        for log, reward, answer in zip(
            self.message_logs[:n], self.rewards[:n].tolist(), answers[:n], strict=True
        ):
            first = next((i for i, m in enumerate(log) if "token_loss_mask" in m), len(log))
            rest = log[first:]
            if len(rest) == 1:
                completion = str(rest[0]["content"])
            else:
                completion = "\n".join(f"[{m['role']}] {m['content']}" for m in rest)
            prompt = "\n".join(f"[{m['role']}] {m['content']}" for m in log[:first])
            sample = {"prompt": prompt, "completion": completion, "reward": reward}
            if answer is not None:
                sample["answer"] = answer
            out.append(sample)
        return out

    def select(self, rows: Iterable[int]) -> RolloutResult:
        """These rows, in this order (metrics are not carried over)."""
        rows = list(rows)
        return RolloutResult(
            message_logs=[self.message_logs[i] for i in rows],
            rewards=self.rewards[rows],
            truncated=self.truncated[rows],
            terminated=self.terminated[rows],
            turns=self.turns[rows],
            env_metadata=[self.env_metadata[i] for i in rows],
            answers=[self.answers[i] for i in rows],
            filler=self.filler[rows],
            task_names=[self.task_names[i] for i in rows] if self.task_names else [],
            group_ids=[self.group_ids[i] for i in rows] if self.group_ids is not None else None,
            reward_components=(
                None if self.reward_components is None else self.reward_components[rows]
            ),
            end_reasons=[self.end_reasons[i] for i in rows] if self.end_reasons else [],
            tool_calls=None if self.tool_calls is None else self.tool_calls[rows],
        )

    def as_filler(self) -> RolloutResult:
        """The same rows, marked as filler."""
        rows = self.select(range(len(self.message_logs)))
        rows.filler = torch.ones_like(rows.filler)
        return rows

    @staticmethod
    def concat(parts: Sequence[RolloutResult]) -> RolloutResult:
        """The rows of ``parts`` one after the other (metrics are not carried over; reward
        components only when every part has the same ones)."""
        first = parts[0].reward_components if parts else None
        components = None
        if first is not None and all(first.same_rewards(p.reward_components) for p in parts):
            values = torch.cat([p.reward_components.values for p in parts])  # type: ignore[union-attr]
            components = RewardComponents(first.names, first.weights, values)
        return RolloutResult(
            message_logs=[log for p in parts for log in p.message_logs],
            rewards=torch.cat([p.rewards for p in parts]),
            truncated=torch.cat([p.truncated for p in parts]),
            terminated=torch.cat([p.terminated for p in parts]),
            turns=torch.cat([p.turns for p in parts]),
            env_metadata=[m for p in parts for m in p.env_metadata],
            answers=[a for p in parts for a in p.answers],
            filler=torch.cat([p.filler for p in parts]),
            task_names=[t for p in parts for t in p.task_names],
            group_ids=(
                [i for p in parts for i in p.group_ids]  # type: ignore[union-attr]
                if all(p.group_ids is not None for p in parts)
                else None
            ),
            reward_components=components,
            end_reasons=(
                [r for p in parts for r in p.end_reasons]
                if all(len(p.end_reasons) == len(p.message_logs) for p in parts)
                else []
            ),
            tool_calls=(
                torch.cat([p.tool_calls for p in parts])  # type: ignore[misc]
                if all(p.tool_calls is not None for p in parts)
                else None
            ),
        )

    def training_batch(self, pad_token_id: int) -> TrainBatch:
        """Right-padded ``input_ids`` with ``loss_mask`` on sampled tokens only and the
        generator's ``generation_logprobs`` aligned to them (0 elsewhere); where the turns
        carry weight versions (async GRPO), ``extras["generation_versions"]``: each sampled
        token's version, aligned the same way (-1 elsewhere); where the generator recorded
        routes (a mixture-of-experts model, ``routed_experts``), those of every token (-1
        where none was recorded, and on padding)."""
        # Only tokens carrying a ``token_loss_mask`` (the sampled ones) are trained on: an
        # assistant turn that came with the prompt (few-shot) was never sampled.
        flat = flatten_message_logs(self.message_logs, pad_token_id, loss_roles=())
        width = flat["input_ids"].shape[1]
        gen_lp = torch.zeros(len(self.message_logs), width, dtype=torch.float32)
        versions = torch.full((len(self.message_logs), width), -1, dtype=torch.long)
        with_versions = False
        for b, log in enumerate(self.message_logs):
            tags = [
                m["generation_versions"]
                if "generation_versions" in m
                else torch.full((len(m["token_ids"]),), -1, dtype=torch.long)
                for m in log
            ]
            with_versions |= any("generation_versions" in m for m in log)
            tagged = torch.cat(tags)
            versions[b, : len(tagged)] = tagged
            pieces = [
                m["generation_logprobs"].float()
                if "generation_logprobs" in m
                else torch.zeros(len(m["token_ids"]))
                for m in log
            ]
            row = torch.cat(pieces)
            gen_lp[b, : len(row)] = row
        return TrainBatch(
            input_ids=flat["input_ids"],
            input_lengths=flat["input_lengths"],
            loss_mask=flat["loss_mask"].to(torch.float32),
            generation_logprobs=gen_lp,
            routed_experts=self._routed_experts(width),
            extras={"generation_versions": versions} if with_versions else {},
        )

    def _routed_experts(self, width: int) -> torch.Tensor | None:
        """``[N, width, layers, k]``: the messages' ``routed_experts`` end to end, -1 where a
        message has none and on padding; None when no message has routes."""
        known = [
            m["routed_experts"] for log in self.message_logs for m in log if "routed_experts" in m
        ]
        if not known:
            return None
        per_token = known[0].shape[1:]
        out = torch.full((len(self.message_logs), width, *per_token), -1, dtype=known[0].dtype)
        for b, log in enumerate(self.message_logs):
            start = 0
            for m in log:
                n = len(m["token_ids"])
                if "routed_experts" in m:
                    out[b, start : start + n] = m["routed_experts"]
                start += n
        return out
