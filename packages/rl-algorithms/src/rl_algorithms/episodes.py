"""The samples of a rollout while it runs (``Episodes``): their conversations as token ids,
their rewards, and how each one ended.

Token in, token out: a generated turn becomes an assistant message whose ``token_ids`` are
exactly the sampled ids (with the generator's per-token ``generation_logprobs``), never
re-tokenised text; an environment's reply is tokenised on its own and appended. A later turn
is generated from the concatenation of those ids, so what is trained on is what was sampled.

The template's text for an assistant turn may continue after the generated stop token (ChatML
writes ``<|im_end|>\\n``); that remainder is tokenised and appended to the assistant message with
``token_loss_mask`` 0, so later turns see the conversation exactly as the template renders it
while the loss and the importance ratios cover only sampled tokens.

Every sampled token also carries the weight version it was sampled with
(``generation_versions``, beside ``generation_logprobs``) when the generator reports versions
(the streaming engines of async GRPO do, see ``token_versions``).

Both rollout loops drive ``Episodes`` one episode at a time (``add_response``, ``apply_step``,
``continue_with``): the lockstep loop (``rollouts.run_lockstep_rollouts``) turn by turn for the
whole batch, the agent loop (``agent_loop.run_agent_loop``) as each episode's own calls return.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rl_algorithms.environment_calls import environment_metrics, step_environments
from rl_algorithms.rollout_result import ENV_TIMEOUT, UNSCORED, RolloutResult
from rl_data.messages import tokenize_message_logs, truncate_message_log
from rl_data.templates import ChatTemplate, Tools
from rl_data.tokenizers import encode_texts
from rl_data.types import TOOLS_KEY, MessageLog
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.interfaces import EnvironmentStep, RewardComponents

logger = logging.getLogger(__name__)

# How an episode ends: its environment ended it, or it reached a limit (turns, its tokens:
# ``max_seq_len``, tool calls, wall time), or its environment did not answer a step in time,
# or answered without a score (those two stay out of the loss: ``RolloutResult.sample_mask``).
TERMINATED = "terminated"
TURN_LIMIT = "turn_limit"
TOKEN_LIMIT = "token_limit"
TOOL_CALL_LIMIT = "tool_call_limit"
TIME_LIMIT = "time_limit"
END_REASONS = (
    TERMINATED,
    TURN_LIMIT,
    TOKEN_LIMIT,
    TOOL_CALL_LIMIT,
    TIME_LIMIT,
    ENV_TIMEOUT,
    UNSCORED,
)


def _is_special(tokenizer: Any, token_id: int) -> bool:
    """Whether the tokenizer counts ``token_id`` as a special token: decoding drops it when
    told to skip special tokens and writes it otherwise (a token that decodes to nothing
    either way, as a sentencepiece word boundary may, is text)."""
    return (
        tokenizer.decode([token_id], skip_special_tokens=True) == ""
        and tokenizer.decode([token_id], skip_special_tokens=False) != ""
    )


def turn_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """A generated turn's text (an assistant message's ``content``): every token as the model
    wrote it, special ones included, less the special tokens it ended with (its stop token,
    which the chat template writes itself after the content).

    Not ``skip_special_tokens``: the markers of some tool-call formats are special tokens
    (Mistral's ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``), and the tool parser reads the
    content; a turn's text without them holds no calls. Keeping them also keeps the content
    what was sampled, so the chat template renders the turn as it was generated.
    """
    end = len(ids)
    while end and _is_special(tokenizer, ids[end - 1]):
        end -= 1
    return tokenizer.decode(list(ids[:end]), skip_special_tokens=False)


def assistant_message(
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    tokenizer: Any,
    template: ChatTemplate,
    log: MessageLog,
    room: int,
    tools: Tools | None = None,
    versions: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The generated turn as a message: the sampled ids as they are, plus the template's
    closing text (if any, and if it fits in ``room`` tokens) as tokens out of the loss.
    ``tools``: those the conversation is offered (its prompt was rendered with them);
    ``versions``: each sampled token's weight version. Its ``template_mismatch`` is set when
    the template renders the turn otherwise than sampled. (The rollouts' episodes and the
    agent-program endpoint's trajectories both make theirs here.)"""
    content = turn_text(tokenizer, ids.tolist())
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "token_ids": ids,
        "token_loss_mask": torch.ones_like(ids),
        "generation_logprobs": logprobs,
    }
    if versions is not None:
        message["generation_versions"] = versions
    generated = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    full = template.message_texts([*log, message], start=len(log), tools=tools)[0]
    if not full.startswith(generated):
        # The template renders this turn otherwise than it was sampled (it strips a think
        # block, say): later turns see the sampled text, not the template's. Counted.
        message["template_mismatch"] = True
        return message
    if len(full) > len(generated):
        tail = torch.tensor(encode_texts(tokenizer, [full[len(generated) :]])[0], dtype=torch.long)
        if len(ids) + len(tail) > room:
            return message
        message["token_ids"] = torch.cat([ids, tail])
        message["token_loss_mask"] = torch.cat([message["token_loss_mask"], torch.zeros_like(tail)])
        message["generation_logprobs"] = torch.cat([logprobs, torch.zeros(len(tail))])
        if versions is not None:  # (out of the loss: tagged like the turn's last token, or
            # with no version, -1 as a prompt token, where nothing was sampled)
            last = versions[-1:] if len(versions) else torch.full((1,), -1, dtype=torch.long)
            message["generation_versions"] = torch.cat([versions, last.expand(len(tail))])
    return message


def token_versions(out: BatchedDataDict, row: int, start: int, length: int) -> torch.Tensor | None:
    """The weight version of each of the ``length`` tokens row ``row`` of a generator's output
    sampled from position ``start`` on; None when the generator reports no versions.

    Exact where the generator reports them per token (``generation_versions``). Where it
    reports only the oldest and newest version of the row (``weight_version_min`` / ``_max``:
    a refit landed while it was sampled and the boundary is unknown), every token is tagged
    with the oldest: an age computed from the tags is never too young."""
    if "generation_versions" in out:
        return out["generation_versions"][row, start : start + length].to(torch.long)
    if "weight_version_min" in out:
        return torch.full((length,), int(out["weight_version_min"][row]), dtype=torch.long)
    return None


def record_routes(log: MessageLog, routes: torch.Tensor) -> None:
    """Give the messages of ``log`` the routes a generator's output row recorded for them
    (``routes`` ``[positions, layers, k]``, covering at least the log's tokens): a message
    without routes gets its slice; one with routes keeps them (the experts its tokens had
    when they were sampled) and takes only those it lacked (``-1``: the tokens of a turn's
    closing text, or its last token, which the generator first ran in this prefill)."""
    start = 0
    for message in log:
        n = len(message["token_ids"])
        got = routes[start : start + n]
        old = message.get("routed_experts")
        message["routed_experts"] = got.clone() if old is None else torch.where(old < 0, got, old)
        start += n


def version_span(log: MessageLog) -> tuple[int, int] | None:
    """The oldest and newest weight version of a conversation's sampled tokens (the newest as
    the generator reported it, which may lie inside a turn); None when none carries versions.
    Only tokens in the loss count (a template's closing tokens are not sampled); turns that
    sampled nothing count with the newest version their generator reported."""
    oldest = [
        int(m["generation_versions"][m["token_loss_mask"] > 0].min())
        for m in log
        if "generation_versions" in m and bool((m["token_loss_mask"] > 0).any())
    ]
    newest = [int(m["generation_version_max"]) for m in log if "generation_version_max" in m]
    if not oldest and not newest:
        return None
    return min(oldest or newest), max([*newest, *oldest])


def group_version_spans(
    logs: list[MessageLog], admitted_version: int, engine: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of a group's episodes' oldest and newest weight version (``[G]`` each), for async
    GRPO's age bound. An episode that sampled nothing (its program failed before its first
    reply, say) takes the group's newest; when no episode sampled anything (its prompt too
    long, say), the engine's version when the group was admitted. Never a made-up version 0,
    which would make a fresh group look as old as the run and get it dropped as stale, again
    and again. Samples without versions are an error naming ``engine``."""
    spans = [version_span(log) for log in logs]
    known = [s for s in spans if s is not None]
    sampled = any(
        bool((m["token_loss_mask"] > 0).any()) for g in logs for m in g if "token_loss_mask" in m
    )
    if not known and sampled:
        raise RuntimeError(
            f"the engine {engine} reported no weight version with its samples "
            "(weight_version_min/_max or generation_versions): async GRPO needs them to bound "
            "the groups' age"
        )
    newest = max(s[1] for s in known) if known else admitted_version
    vmin = torch.tensor([newest if s is None else s[0] for s in spans], dtype=torch.long)
    vmax = torch.tensor([newest if s is None else s[1] for s in spans], dtype=torch.long)
    return vmin, vmax


# What of an environment's reply message reaches the conversation (and the chat template).
_OBSERVATION_KEYS = ("role", "content", "tool_call_id", "name")


def _observation_messages(step: EnvironmentStep) -> list[dict[str, Any]]:
    """The messages an environment step appends: their text fields only (token ids are made
    by tokenising them in the conversation)."""
    return [{k: m[k] for k in _OBSERVATION_KEYS if k in m} for m in step.messages]  # type: ignore[literal-required]


_warned_of_template_mismatch = False


def _warn_of_template_mismatch(content: str) -> None:
    """Once per process: the metric ``template_mismatched_turns`` counts them all."""
    global _warned_of_template_mismatch
    _warned_of_template_mismatch = True
    logger.warning(
        "the chat template renders a generated turn otherwise than it was sampled (e.g. it "
        "drops a think block), so later turns continue from the sampled text, not the "
        "template's; counted in template_mismatched_turns. Turn: %.200r",
        content,
    )


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


def tool_calls_of(step: EnvironmentStep) -> int:
    """The tool calls a step answered: a tool environment answers each with a ``role: tool``
    message of its own."""
    return sum(1 for m in step.messages if m.get("role") == "tool")


class Episodes:
    """The samples of one rollout while it runs: their logs, rewards and how each ended.

    The rollout loops call, for an episode ``i``: ``add_response`` with its generated turn,
    ``apply_step`` with its environment's answer, then ``continue_with`` (several episodes at
    once: their observations are tokenised together), or ``finish`` with the reason it stops.
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
        # The tools each conversation is offered: every later turn is rendered with them, as
        # its prompt was (the metadata an environment passes back may leave them out).
        self.tools = [(m or {}).get(TOOLS_KEY) for m in batch["extra_env_info"]]
        self.tasks = list(batch["task_name"])
        self.group_ids = [int(i) for i in batch["idx"]] if "idx" in batch else None
        self.tokenizer, self.template, self.envs = tokenizer, template, envs
        self.max_seq_len = max_seq_len
        self.rewards = torch.zeros(n, dtype=torch.float32)
        self.truncated = torch.zeros(n, dtype=torch.bool)
        self.out_of_room = torch.zeros(n, dtype=torch.bool)  # reached max_seq_len: stops
        self.terminated = torch.zeros(n, dtype=torch.bool)
        self.turns = torch.zeros(n, dtype=torch.long)
        self.tool_calls = torch.zeros(n, dtype=torch.long)
        self.end_reasons: list[str | None] = [None] * n
        self.answers: list[str | None] = [None] * n
        # Each sample's reward components so far ([K], summed over turns), and whether a turn
        # came without them (or with other ones): then the rollout has none.
        self.components: list[RewardComponents | None] = [None] * n
        self.without_components = torch.zeros(n, dtype=torch.bool)
        self.stops: list[Any] = [None] * n
        # Per turn: the tokens each episode generated and the reward it got (the metrics of
        # ``result``, the same whichever loop played the turns).
        self.turn_lengths: dict[int, list[int]] = defaultdict(list)
        self.turn_rewards: dict[int, list[float]] = defaultdict(list)
        self.metrics: dict[str, float] = {}
        self.timings: dict[str, float] = {}
        # Turns whose text the chat template renders otherwise than it was sampled.
        self.template_mismatches = 0
        # When the rollout started and when each episode ended (its wall time).
        self.started_at = time.monotonic()
        self.finished_at: list[float | None] = [None] * n
        for i in range(n):
            self.out_of_room[i] = self.truncated[i] = _length(self.logs[i]) >= max_seq_len
            if self.out_of_room[i]:
                self.finish(i, TOKEN_LIMIT)
        self.active = [i for i in range(n) if not self.out_of_room[i]]

    def generation_input(self, rows: Sequence[int] | None = None) -> BatchedDataDict:
        """Episodes ``rows`` (default: the active ones), as the generator's input."""
        rows = self.active if rows is None else rows
        logs = [self.logs[i] for i in rows]
        return generation_input(logs, [self.stops[i] for i in rows], self.tokenizer.pad_token_id)

    def add_response(self, i: int, out: BatchedDataDict, row: int) -> None:
        """Row ``row`` of the generator's output becomes episode ``i``'s next assistant turn
        (cut to what fits in ``max_seq_len``)."""
        log = self.logs[i]
        start = _length(log)
        length = int(out["generation_lengths"][row])
        room = self.max_seq_len - start
        if length >= room:
            self.out_of_room[i] = True
        if length > room or bool(out["truncated"][row]):
            self.truncated[i] = True
        length = min(length, room)
        ids = out["output_ids"][row, start : start + length].to(torch.long)
        lps = out["logprobs"][row, start : start + length].to(torch.float32)
        versions = token_versions(out, row, start, length)
        message = assistant_message(
            ids, lps, self.tokenizer, self.template, log, room, self.tools[i], versions
        )
        if "routed_experts" in out:  # a mixture-of-experts generator's routes (router replay)
            routes = out["routed_experts"][row]
            record_routes(log, routes)
            tail = len(message["token_ids"]) - length  # the template's closing text: not run
            message["routed_experts"] = torch.cat(
                [routes[start : start + length], routes.new_full((tail, *routes.shape[1:]), -1)]
            )
        if "weight_version_max" in out:
            message["generation_version_max"] = int(out["weight_version_max"][row])
        if message.pop("template_mismatch", False):
            self.template_mismatches += 1
            if not _warned_of_template_mismatch:
                _warn_of_template_mismatch(message["content"])
        log.append(message)  # type: ignore[arg-type]
        self.turn_lengths[int(self.turns[i])].append(length)
        self.turns[i] += 1

    def apply_step(self, i: int, step: EnvironmentStep) -> None:
        """Episode ``i``'s environment answered its latest turn (every turn that was generated
        is scored, truncated ones too: their reward says so)."""
        self.rewards[i] += step.reward
        self._add_components(i, step.reward_components)
        self.turn_rewards[int(self.turns[i]) - 1].append(step.reward)
        self.metadata[i] = step.metadata
        self.stops[i] = step.next_stop_strings
        self.answers[i] = step.answer
        self.terminated[i] = step.terminated
        self.tool_calls[i] += tool_calls_of(step)
        if step.unscored:
            self.finish(i, UNSCORED)
        elif step.terminated:
            self.finish(i, TERMINATED)
        elif self.out_of_room[i]:
            self.finish(i, TOKEN_LIMIT)

    def goes_on(self, i: int) -> bool:
        """Whether episode ``i`` has not ended (by its environment, its length, or a limit)."""
        return self.end_reasons[i] is None

    def continue_with(self, rows: Sequence[int], steps: Sequence[EnvironmentStep]) -> list[int]:
        """Append each step's observation to its episode (``rows``: episodes that go on),
        ready for their next turn; an episode whose observation does not fit in
        ``max_seq_len`` is cut there and stops. The episodes that go on."""
        for i, step in zip(rows, steps, strict=True):
            self.logs[i].extend(_observation_messages(step))
        logs = [self.logs[i] for i in rows]
        tokenize_message_logs(
            logs,
            self.tokenizer,
            self.template,
            add_generation_prompt=True,
            tools=[self.tools[i] for i in rows],
        )
        going = []
        for i in rows:
            if _length(self.logs[i]) >= self.max_seq_len:  # the episode is cut short
                self.out_of_room[i] = self.truncated[i] = True
                # and the observation cut to the limit: no row may outgrow max_seq_len
                self.logs[i][:] = truncate_message_log(self.logs[i], self.max_seq_len)
                self.finish(i, TOKEN_LIMIT)
            else:
                going.append(i)
        return going

    def finish(self, i: int, reason: str) -> None:
        """Episode ``i`` ends for ``reason`` (the first reason given is kept)."""
        if self.end_reasons[i] is None:
            self.end_reasons[i] = reason
            self.finished_at[i] = time.monotonic()

    def play_turn(self, out: BatchedDataDict, last: bool) -> None:
        """The lockstep turn: the active samples' responses (``out``, one row each) become
        assistant messages, the environments answer, and the samples that go on get the
        observation."""
        active = self.active
        for j, i in enumerate(active):
            self.add_response(i, out, j)
        results = step_environments(
            self.envs,
            [self.logs[i] for i in active],
            [self.metadata[i] for i in active],
            [self.tasks[i] for i in active],
        )
        for i, step in zip(active, results, strict=True):
            self.apply_step(i, step)
        going = [(i, step) for i, step in zip(active, results, strict=True) if self.goes_on(i)]
        if last:
            for i, _ in going:
                self.finish(i, TURN_LIMIT)
            going = []
        self.active = self.continue_with([i for i, _ in going], [s for _, s in going])

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
        for i in range(n):  # still playing when the turns ran out
            self.finish(i, TURN_LIMIT)
        seconds = [end - self.started_at for end in self.finished_at if end is not None]
        metrics = {
            **self.metrics,
            **self._turn_metrics(),
            "mean_turns": float(self.turns.double().mean()),
            "template_mismatched_turns": float(self.template_mismatches),
            "mean_tool_calls": float(self.tool_calls.double().mean()),
            **{
                f"end_reason/{reason}": sum(r == reason for r in self.end_reasons) / n
                for reason in END_REASONS
            },
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
            end_reasons=[str(r) for r in self.end_reasons],
            tool_calls=self.tool_calls,
            timings={
                **self.timings,
                "episode_seconds_mean": sum(seconds) / n if n else 0.0,
                "episode_seconds_max": max(seconds, default=0.0),
            },
        )

    def _turn_metrics(self) -> dict[str, float]:
        """Per turn ``t``: how many episodes generated one, their mean length, and the mean
        reward of those their environment scored."""
        out = {}
        for turn, lengths in sorted(self.turn_lengths.items()):
            out[f"turn_{turn}/active_samples"] = float(len(lengths))
            out[f"turn_{turn}/mean_generation_length"] = sum(lengths) / len(lengths)
            rewards = self.turn_rewards.get(turn)
            if rewards:
                out[f"turn_{turn}/reward_mean"] = sum(rewards) / len(rewards)
        return out
