"""Rollouts: generate, let the environments answer, repeat until every sample is done.

A rollout starts from tokenised prompts (message logs whose last message ends with the
assistant header, as ``rl_data`` processors make them) and runs up to ``max_turns`` turns:

1. every *active* sample's log is flattened to token ids and generated from (one batched call);
2. the response becomes an assistant message whose ``token_ids`` are exactly the generated ids
   (with the generator's per-token ``generation_logprobs``), never re-tokenised text;
3. samples are grouped by ``task_name`` and each environment actor steps its group in one
   batched call (all environments at once);
4. rewards add up (and so do their components, when the environments keep them apart: see
   ``RolloutResult.reward_components``); a terminated sample stops; the others get the observation appended,
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from rl_data.batch import TrainBatch
from rl_data.collate import flatten_message_logs
from rl_data.messages import tokenize_message_logs, truncate_message_log
from rl_data.templates import ChatTemplate
from rl_data.tokenizers import encode_texts
from rl_data.types import MessageLog
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.interfaces import EnvironmentReturn, EnvironmentStep, RewardComponents
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

    def __post_init__(self) -> None:
        if self.filler is None:
            self.filler = torch.zeros(len(self.message_logs), dtype=torch.bool)

    def environment_metrics(self, envs: Mapping[str, Any]) -> dict[str, float]:
        """The environments' metrics of these samples (``env/<task>/<name>``); a call to each
        environment, which also hands out (and resets) the counts it kept since its last."""
        return environment_metrics(envs, self.task_names, self.rewards, self.group_ids)

    def samples(self, n: int) -> list[dict[str, Any]]:
        """The first ``n`` samples as text, to look at: ``prompt`` (the messages before the
        first generated turn), ``completion`` (the rest: one turn, or a whole multi-turn
        exchange with each message's role) and ``reward``."""
        out = []
        for log, reward in zip(self.message_logs[:n], self.rewards[:n].tolist(), strict=True):
            first = next((i for i, m in enumerate(log) if "token_loss_mask" in m), len(log))
            rest = log[first:]
            if len(rest) == 1:
                completion = str(rest[0]["content"])
            else:
                completion = "\n".join(f"[{m['role']}] {m['content']}" for m in rest)
            prompt = "\n".join(f"[{m['role']}] {m['content']}" for m in log[:first])
            out.append({"prompt": prompt, "completion": completion, "reward": reward})
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
        )

    def training_batch(self, pad_token_id: int) -> TrainBatch:
        """Right-padded ``input_ids`` with ``loss_mask`` on sampled tokens only and the
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
        return TrainBatch(
            input_ids=flat["input_ids"],
            input_lengths=flat["input_lengths"],
            loss_mask=flat["loss_mask"].to(torch.float32),
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
) -> list[EnvironmentStep]:
    """One environment step per sample, in the order of ``logs``, batched per environment and
    run concurrently."""
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
    steps: dict[int, EnvironmentStep] = {}
    for task, rows in by_task.items():
        ret = _resolve(pending[task])
        if len(ret.rewards) != len(rows):
            raise RuntimeError(
                f"environment {task!r} returned {len(ret.rewards)} rewards for {len(rows)} samples"
            )
        steps.update(zip(rows, ret.steps(), strict=True))
    return [steps[i] for i in range(len(logs))]


def environment_metrics(
    envs: Mapping[str, Any],
    task_names: Sequence[str],
    rewards: torch.Tensor,
    group_ids: Sequence[Any] | None,
) -> dict[str, float]:
    """Each environment's own metrics over its samples of a rolled-out batch (accuracy,
    pass@k, timeouts, verifier errors...), as ``env/<task>/<name>``; run concurrently.

    ``group_ids`` (the dataset row of each sample: the G samples of a prompt share it) lets
    an environment report pass@k.
    """
    by_task: dict[str, list[int]] = defaultdict(list)
    for i, task in enumerate(task_names):
        if task in envs:  # a sample too long to generate from never met its environment
            by_task[task].append(i)
    batches: dict[str, dict[str, Any]] = {}
    for task, rows in by_task.items():
        batches[task] = {"rewards": rewards[rows]}
        if group_ids is not None:
            batches[task]["group_ids"] = [group_ids[i] for i in rows]
    return _post_process(envs, batches)


def take_environment_counts(envs: Mapping[str, Any]) -> dict[str, float]:
    """What every environment counted since its last metrics call (``env/<task>/<name>``:
    samples, timeouts, per-function values...), which starts its counts again from zero; a
    call with no samples, so no reward metrics."""
    empty = {task: {"rewards": torch.zeros(0)} for task in envs}
    return _post_process(envs, empty)


def _post_process(envs: Mapping[str, Any], batches: Mapping[str, dict]) -> dict[str, float]:
    """Each environment's ``global_post_process_and_metrics`` of its batch, concurrently."""
    pending = {}
    for task, batch in batches.items():
        post = envs[task].global_post_process_and_metrics
        pending[task] = post.remote(batch) if hasattr(post, "remote") else post(batch)
    out = {}
    for task, call in pending.items():
        _, metrics = ray.get(call) if isinstance(call, ray.ObjectRef) else call
        out.update({f"env/{task}/{name}": float(value) for name, value in metrics.items()})
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


# What of an environment's reply message reaches the conversation (and the chat template).
_OBSERVATION_KEYS = ("role", "content", "tool_call_id", "name")


def _observation_messages(step: EnvironmentStep) -> list[dict[str, Any]]:
    """The messages an environment step appends: their text fields only (token ids are made
    by tokenising them in the conversation)."""
    return [{k: m[k] for k in _OBSERVATION_KEYS if k in m} for m in step.messages]  # type: ignore[literal-required]


def _length(log: MessageLog) -> int:
    return sum(len(m["token_ids"]) for m in log)


def generation_input(
    logs: Sequence[MessageLog], stops: Sequence[Any], pad_id: int
) -> BatchedDataDict:
    """What a generator samples from: each log flattened to right-padded token ids, with the
    stop strings its environment asked for."""
    rows = [torch.cat([m["token_ids"] for m in log]) for log in logs]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    ids = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, stop_strings=list(stops))


class Episodes:
    """The samples of one rollout while it runs: their logs, rewards and how each ended.

    ``run_rollouts`` drives it turn by turn with a generator; async GRPO's collector, whose
    engine has already sampled a group, plays that single turn with ``score_generated``.
    """

    def __init__(
        self,
        batch: BatchedDataDict,
        tokenizer: Any,
        template: ChatTemplate,
        envs: Mapping[str, Any],
        max_seq_len: int,
    ) -> None:
        # The input's message logs are copied, never changed.
        self.logs: list[MessageLog] = [[dict(m) for m in log] for log in batch["message_log"]]  # type: ignore[misc]
        n = len(self.logs)
        self.metadata = [copy.deepcopy(m) for m in batch["extra_env_info"]]
        self.tasks = list(batch["task_name"])
        self.group_ids = [int(i) for i in batch["idx"]] if "idx" in batch else None
        self.tokenizer, self.template, self.envs = tokenizer, template, envs
        self.max_seq_len = max_seq_len
        self.rewards = torch.zeros(n, dtype=torch.float32)
        self.truncated = torch.zeros(n, dtype=torch.bool)
        self.out_of_room = torch.zeros(n, dtype=torch.bool)  # reached max_seq_len: stops
        self.terminated = torch.zeros(n, dtype=torch.bool)
        self.turns = torch.zeros(n, dtype=torch.long)
        self.answers: list[str | None] = [None] * n
        # Each sample's reward components so far ([K], summed over turns), and whether a turn
        # came without them (or with other ones): then the rollout has none.
        self.components: list[RewardComponents | None] = [None] * n
        self.without_components = torch.zeros(n, dtype=torch.bool)
        self.stops: list[Any] = [None] * n
        self.metrics: dict[str, float] = {}
        for i in range(n):
            self.out_of_room[i] = self.truncated[i] = _length(self.logs[i]) >= max_seq_len
        self.active = [i for i in range(n) if not self.out_of_room[i]]

    def generation_input(self) -> BatchedDataDict:
        """The active samples, as the generator's input."""
        logs = [self.logs[i] for i in self.active]
        return generation_input(
            logs, [self.stops[i] for i in self.active], self.tokenizer.pad_token_id
        )

    def play_turn(self, turn: int, out: BatchedDataDict, last: bool) -> None:
        """The active samples' responses (``out``, one row each) become assistant messages,
        the environments answer, and the samples that go on get the observation."""
        logs, active, max_seq_len = self.logs, self.active, self.max_seq_len
        gen_tokens = 0
        for j, i in enumerate(active):
            start = _length(logs[i])
            length = int(out["generation_lengths"][j])
            room = max_seq_len - start
            if length >= room:
                self.out_of_room[i] = True
            if length > room or bool(out["truncated"][j]):
                self.truncated[i] = True
            length = min(length, room)
            ids = out["output_ids"][j, start : start + length].to(torch.long)
            lps = out["logprobs"][j, start : start + length].to(torch.float32)
            message = _assistant_message(ids, lps, self.tokenizer, self.template, logs[i], room)
            logs[i].append(message)  # type: ignore[arg-type]
            self.turns[i] += 1
            gen_tokens += length
        # Every sample that generated is scored, truncated ones too (their reward says so).
        results = step_environments(
            self.envs,
            [logs[i] for i in active],
            [self.metadata[i] for i in active],
            [self.tasks[i] for i in active],
        )
        turn_rewards = []
        for i, step in zip(active, results, strict=True):
            self.rewards[i] += step.reward
            self._add_components(i, step.reward_components)
            turn_rewards.append(step.reward)
            self.metadata[i] = step.metadata
            self.stops[i] = step.next_stop_strings
            self.answers[i] = step.answer
            self.terminated[i] = step.terminated
        self.metrics[f"turn_{turn}/active_samples"] = float(len(active))
        self.metrics[f"turn_{turn}/mean_generation_length"] = gen_tokens / len(active)
        self.metrics[f"turn_{turn}/reward_mean"] = sum(turn_rewards) / len(turn_rewards)

        going = [i for i in active if not self.terminated[i] and not self.out_of_room[i]]
        if not last and going:
            for i, step in zip(active, results, strict=True):
                if i in going:
                    logs[i].extend(_observation_messages(step))
            tokenize_message_logs(
                [logs[i] for i in going], self.tokenizer, self.template, add_generation_prompt=True
            )
            for i in going:
                if _length(logs[i]) >= max_seq_len:  # the episode is cut short
                    self.out_of_room[i] = self.truncated[i] = True
                    # and the observation cut to the limit: no row may outgrow max_seq_len
                    logs[i][:] = truncate_message_log(logs[i], max_seq_len)
        self.active = [i for i in going if not self.out_of_room[i]]

    def _add_components(self, i: int, components: RewardComponents | None) -> None:
        """Sum sample ``i``'s reward components over its turns, as its rewards are summed."""
        mine = self.components[i]
        if components is None or (mine is not None and not mine.same_rewards(components)):
            self.without_components[i] = True
        elif mine is None:
            self.components[i] = components
        else:
            self.components[i] = RewardComponents(
                mine.names, mine.weights, mine.values + components.values
            )

    def stacked_components(self) -> RewardComponents | None:
        """The samples' reward components as one ``[N, K]`` (see ``RolloutResult``)."""
        met = [c for c in self.components if c is not None]
        if not met or bool(self.without_components.any()):
            return None
        if not all(met[0].same_rewards(c) for c in met):
            return None
        zeros = torch.zeros(len(met[0].names), dtype=torch.float32)
        values = torch.stack([zeros if c is None else c.values.float() for c in self.components])
        return RewardComponents(met[0].names, met[0].weights, values)

    def result(self, with_env_metrics: bool = True) -> RolloutResult:
        """The rollout's outcome; ``with_env_metrics`` asks every environment for its metrics
        of these samples (a call to each environment actor)."""
        logs, n = self.logs, len(self.logs)
        lengths = [
            sum(int(m["token_loss_mask"].sum()) for m in log if "token_loss_mask" in m)
            for log in logs
        ]
        metrics = {
            **self.metrics,
            "mean_turns": float(self.turns.double().mean()),
            "truncated_fraction": float(self.truncated.double().mean()),
            "terminated_fraction": float(self.terminated.double().mean()),
            "mean_generated_tokens": sum(lengths) / n,
            # The longest response: how many decoding steps the batch took (one generation round).
            "max_generated_tokens": float(max(lengths, default=0)),
            "completion_tokens": float(sum(lengths)),
            "reward_mean": float(self.rewards.double().mean()),
            **(
                environment_metrics(self.envs, self.tasks, self.rewards, self.group_ids)
                if with_env_metrics
                else {}
            ),
        }
        return RolloutResult(
            logs,
            self.rewards,
            self.truncated,
            self.terminated,
            self.turns,
            self.metadata,
            self.answers,
            metrics,
            task_names=list(self.tasks),
            group_ids=self.group_ids,
            reward_components=self.stacked_components(),
        )


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
) -> RolloutResult:
    """Roll ``batch`` (``message_log``, ``extra_env_info``, ``task_name``) out to the end.

    ``envs`` maps task names to environment actors (or in-process environments).
    ``with_env_metrics``: the environments' metrics of this batch go into ``metrics`` (off:
    a caller that rolls out several batches asks once for all of them, see
    ``RolloutResult.environment_metrics``).
    """
    episodes = Episodes(batch, tokenizer, template, envs, max_seq_len)
    for turn in range(max_turns):
        if not episodes.active:
            break
        out = generation.generate(
            episodes.generation_input(),
            greedy=greedy,
            expected_weight_version=expected_weight_version,
        )
        episodes.play_turn(turn, out, last=turn + 1 == max_turns)
    return episodes.result(with_env_metrics)


def score_generated(
    batch: BatchedDataDict,
    out: BatchedDataDict | None,
    tokenizer: Any,
    template: ChatTemplate,
    envs: Mapping[str, Any],
    *,
    max_seq_len: int,
) -> RolloutResult:
    """A single-turn rollout whose responses were already sampled (``out``, one row per row of
    ``batch``; ``None`` when every prompt is too long to generate from)."""
    episodes = Episodes(batch, tokenizer, template, envs, max_seq_len)
    if episodes.active:
        if out is None or out.size != len(episodes.active):
            got = "none" if out is None else out.size
            raise ValueError(f"{len(episodes.active)} rows to score, {got} generated")
        episodes.play_turn(0, out, last=True)
    # No environment metrics per group: async GRPO scores its groups one by one and does not
    # merge their metrics, so a call to every environment per group would be wasted work.
    return episodes.result(with_env_metrics=False)
