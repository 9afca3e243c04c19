"""The tool environment (``env.<task>.kind: tools``): the model calls tools over several turns,
then answers; its answer is scored by reward functions::

    env:
      calc:
        kind: tools
        config:
          tools: [calculator, {function: my_tools.py:lookup}]
          parser: hermes                 # how the model writes calls: hermes, llama3_json, mistral
          tool_timeout_s: 10             # per call
          max_output_chars: 4000         # per call's output
          max_tool_calls: 8              # per episode
          functions:                     # the reward, as in kind: reward_functions
            - {function: my_rewards.py:correct}

Each turn's tool calls are read from its text (:mod:`rl_envs.tools.parsers`), checked against
the tools' schemas (:mod:`rl_envs.tools.registry`) and run in a pool of verifier processes, each
call under ``tool_timeout_s`` (a call that hangs has its process killed) with at most
``max_output_chars`` of output. The environment answers each call with a ``role: tool`` message
(``tool_call_id``, ``name``, ``content``), the episode goes on, and the turn's reward is 0.
Whatever goes wrong with a call (it cannot be read, names no tool on offer, has wrong arguments,
hangs, raises, returns no ``str``, floods output) is told to the model in its tool message, and
counted; never a crash.

A turn without a call is the final answer; so is a turn with calls once the episode has made
``max_tool_calls`` of them. The calls of a turn beyond the budget are not run: one tool message
(answering the first of them) says so, however many there are, and the model gets one more
turn to answer. The answer is scored by the reward functions, called as in
``kind: reward_functions`` (the answer is the completion), with three more keyword arguments:
``trajectory`` (the whole conversation: role, content, and ``tool_calls`` parsed from each
assistant turn, ``tool_call_id``/``name`` on tool messages), ``tool_calls`` (calls made in the
episode) and ``tool_errors`` (those that failed) — so a reward can pay for correct answers and
charge for malformed calls. An episode that the rollout's turn limit ends before the final
answer is never scored here (its reward stays 0).

The tools on offer are a sample's ``tools`` column (OpenAI schemas, as the chat template
renders them; a JSON string of them is read too) when it has one, else all configured tools.
Per-episode state (turns, calls, errors) travels in the sample's metadata under ``tool_episode``.

The environment serves concurrent steps (``concurrent_steps``): its actor runs up to
``rl_envs.interfaces.MAX_CONCURRENT_STEPS`` calls at once, each in a thread of its own, and
the agent loop steps each episode on its own call, so an episode goes on as soon as its own
tools return. Tool calls and scoring run unlocked (the worker pools spread concurrent calls
over their workers); only the counters behind the metrics are shared: each step counts into
its own, added to the environment's under a lock.
"""

from __future__ import annotations

import json
import threading
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from rl_data.types import Message, MessageLog
from rl_envs.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    RewardComponents,
    check_required_metadata,
    last_assistant_text,
)
from rl_envs.pool import Outcome, WorkerPool
from rl_envs.reward_function_env import RewardFunctionsEnvConfig, RewardFunctionsEnvironment
from rl_envs.tools.builtin import python_tool_limits
from rl_envs.tools.parsers import FORMATS, ToolCall, malformed_message, parse_tool_calls
from rl_envs.tools.registry import Tool, ToolSpec, builtin_for, tool_schema

STATE_KEY = "tool_episode"
# What the reward functions get from the environment besides the row's columns.
PROVIDED_COLUMNS = ("trajectory", "tool_calls", "tool_errors")
# Why a call failed, as counted in the metrics (tools/errors/<kind>).
ERROR_KINDS = (
    "malformed",
    "unknown_tool",
    "bad_arguments",
    "over_budget",
    "raised",
    "bad_return",
    "too_long",
    "timeout",
    "crashed",
)


class ToolEnvConfig(RewardFunctionsEnvConfig):
    # One tool call a call: calls are slow and uneven (code runs, searches), and balance best
    # handed to whichever worker is free.
    chunk_size: int | None = Field(1, ge=1)
    # The tools (see rl_envs.tools.registry): a built-in name, a function reference, or
    # {function, name, kwargs}.
    tools: list[ToolSpec] = Field(min_length=1)
    # How the model writes tool calls: hermes (Qwen, Hermes, SmolLM2), llama3_json, mistral.
    parser: str = "hermes"
    tool_timeout_s: float = Field(10.0, gt=0)  # per call; a call that runs longer is killed
    max_output_chars: int = Field(4000, ge=1)  # per call; longer output is cut, and an error
    max_tool_calls: int = Field(8, ge=1)  # per episode
    config_key: str = "tools"

    @field_validator("parser")
    @classmethod
    def _known_format(cls, parser: str) -> str:
        if parser not in FORMATS:
            raise ValueError(f"parser {parser!r}: expected one of {sorted(FORMATS)}")
        return parser

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[ToolSpec]) -> list[ToolSpec]:
        names = [t.name for t in tools]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"two tools are named {repeated[0]!r}: give one a 'name'")
        return tools

    @model_validator(mode="after")
    def _sandbox_within_the_timeout(self) -> ToolEnvConfig:
        for tool in self.tools:
            builtin = builtin_for(tool.function)
            if builtin is not None and builtin[0] == "python":
                limits = python_tool_limits(tool.kwargs.get("limits"))
                # The call's timeout is the backstop for the sandbox's own wall-time limit.
                if limits.wall_time_s >= self.tool_timeout_s:
                    raise ValueError(
                        f"tool_timeout_s ({self.tool_timeout_s:g}) must exceed the python tool's "
                        f"sandbox wall_time_s ({limits.wall_time_s:g}), which bounds each program"
                    )
        return self


@dataclass
class _PerTool:
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    ran: int = 0  # calls whose function ran (and took ``seconds``)
    seconds: float = 0.0


def _tool_message(call: ToolCall) -> Message:
    """The ``role: tool`` message answering ``call`` (its content still to be written)."""
    message: Message = {"role": "tool", "tool_call_id": call.id, "content": ""}
    if call.name:
        message["name"] = call.name
    return message


class ToolStats:
    """What the tool calls did since the metrics were last taken; or in one step, then added
    to the environment's (:meth:`add`) under its lock."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.per_tool: dict[str, _PerTool] = defaultdict(_PerTool)
        self.errors: Counter[str] = Counter()
        self.calls = 0  # every call written, readable or not
        self.episodes = self.episode_turns = self.episode_calls = 0

    def count(self, call: ToolCall, offered: Mapping[str, Tool], kind: str | None) -> None:
        """One call, and its error kind (None: it worked)."""
        self.calls += 1
        if call.name in offered:
            per_tool = self.per_tool[call.name]
            per_tool.calls += 1
            per_tool.errors += kind is not None
            per_tool.timeouts += kind == "timeout"
        if kind is not None:
            self.errors[kind] += 1

    def add(self, other: ToolStats) -> None:
        """Count ``other``'s calls and episodes in too."""
        for name, theirs in other.per_tool.items():
            mine = self.per_tool[name]
            for f in fields(_PerTool):
                setattr(mine, f.name, getattr(mine, f.name) + getattr(theirs, f.name))
        self.errors.update(other.errors)
        self.calls += other.calls
        self.episodes += other.episodes
        self.episode_turns += other.episode_turns
        self.episode_calls += other.episode_calls

    def take(self) -> dict[str, float]:
        out: dict[str, float] = {"tools/calls": float(self.calls)}
        out.update({f"tools/errors/{k}": float(self.errors[k]) for k in ERROR_KINDS})
        if self.calls:
            out["tools/malformed_rate"] = self.errors["malformed"] / self.calls
        for name, t in sorted(self.per_tool.items()):
            out.update({f"tool/{name}/{k}": float(getattr(t, k)) for k in ("calls", "errors")})
            out[f"tool/{name}/timeouts"] = float(t.timeouts)
            if t.ran:
                out[f"tool/{name}/mean_latency_s"] = t.seconds / t.ran
        out["tools/episodes"] = float(self.episodes)
        if self.episodes:
            out["tools/turns_per_episode"] = self.episode_turns / self.episodes
            out["tools/calls_per_episode"] = self.episode_calls / self.episodes
        self.reset()
        return out


class ToolEnvironment(EnvironmentInterface):
    """Multi-turn tool calling; see the module's docstring."""

    returns_reward_components = True
    concurrent_steps = True

    def __init__(self, cfg: ToolEnvConfig) -> None:
        self.cfg = cfg
        self.tools = {spec.name: Tool(spec) for spec in cfg.tools}
        self.required_metadata = self.required_metadata_for(cfg)  # type: ignore[misc]
        self.stats = ToolStats()
        self._stats_lock = threading.Lock()  # steps run in several threads at once
        preload: list[str] = []
        warmups: list[tuple[str, tuple]] = []
        for spec in cfg.tools:
            builtin = builtin_for(spec.function)
            preload += builtin[1].preload if builtin else [spec.function]
            if builtin and builtin[1].prepare:
                warmups.append(
                    ("rl_envs.tools.execute:prepare_tool", (builtin[1].prepare, spec.kwargs))
                )
            if builtin and builtin[0] == "python":
                from rl_envs.code.sandbox import require_isolation

                # Refused at setup, not per call, when model code could not be isolated here.
                require_isolation(python_tool_limits(spec.kwargs.get("limits")))
        self._pool = WorkerPool(
            "rl_envs.tools.execute:run_tool",
            num_workers=cfg.num_workers,
            timeout_s=cfg.tool_timeout_s,
            chunk_size=cfg.chunk_size,
            num_cpus_per_worker=cfg.num_cpus_per_worker,
            preload=tuple(dict.fromkeys(preload)),
            warmups=tuple(warmups),
        )
        # The reward functions get a pool of their own that reserves no CPU: within a step the
        # tools run first and the scoring after, so the CPUs reserved for the tools are free.
        reward_cfg = RewardFunctionsEnvConfig.model_validate(
            {
                **cfg.model_dump(include=set(RewardFunctionsEnvConfig.model_fields)),
                "num_cpus_per_worker": 0.0,
            }
        )
        try:
            self._rewards = RewardFunctionsEnvironment(reward_cfg)
        except BaseException:
            self._pool.shutdown()
            raise

    @classmethod
    def required_metadata_for(cls, cfg: ToolEnvConfig) -> tuple[str, ...]:
        """The reward functions' columns, less those the environment gives them itself."""
        columns = RewardFunctionsEnvironment.required_metadata_for(cfg)
        return tuple(c for c in columns if c not in PROVIDED_COLUMNS)

    @classmethod
    def offered_tools_for(cls, cfg: ToolEnvConfig) -> list[dict[str, Any]]:
        """Every configured tool's schema: what a row without a ``tools`` column is offered."""
        return [tool_schema(spec) for spec in cfg.tools]

    def _offered(self, meta: Mapping[str, Any] | None, i: int) -> dict[str, Tool]:
        """The tools sample ``i`` offers: its ``tools`` column, else every configured tool."""
        offered = (meta or {}).get("tools")
        if offered is None:
            return self.tools
        where = f"{type(self).__name__}: sample {i} of the batch's 'tools' column"
        if isinstance(offered, str):  # datasets often keep the schemas as a JSON string
            try:
                offered = json.loads(offered)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is a string but not JSON: {e}") from None
        names = []
        for schema in offered if isinstance(offered, list) else [offered]:
            inner = schema.get("function", schema) if isinstance(schema, dict) else None
            if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
                raise ValueError(f"{where}: expected OpenAI tool schemas, got {schema!r:.200}")
            names.append(inner["name"])
        missing = [n for n in names if n not in self.tools]
        if missing:
            raise ValueError(
                f"{where} offers the tool {missing[0]!r}, which {self.cfg.config_key}.tools does "
                f"not configure (it has {sorted(self.tools)})"
            )
        return {n: self.tools[n] for n in names}

    def _refusal(self, call: ToolCall, offered: Mapping[str, Tool]) -> tuple[str, str] | None:
        """Why ``call`` cannot run (its error kind and what the model is told), or None."""
        if call.error is not None:
            return "malformed", malformed_message(call, self.cfg.parser)
        tool = offered.get(call.name)
        if tool is None:
            return "unknown_tool", (
                f"Error: there is no tool {call.name!r}. The tools are: {', '.join(offered)}."
            )
        problems = tool.argument_errors(call.arguments)
        if problems:
            return "bad_arguments", (
                f"Error: wrong arguments for {call.name!r}: {'; '.join(problems)}. Its "
                f"parameters: {tool.describe_parameters()}"
            )
        return None

    def _over_budget(
        self,
        calls: list[ToolCall],
        offered: Mapping[str, Tool],
        stats: ToolStats,
        state: dict[str, int],
    ) -> list[Message]:
        """The messages answering the calls of a turn made once the episode's budget is spent
        (each counted as an ``over_budget`` error): every call gets its reply, as chat templates
        and APIs pair a call with its answer; the first says why and what to do (answer now),
        the others only that they were not run."""
        for call in calls:
            stats.count(call, offered, "over_budget")
        state["calls"] += len(calls)
        state["errors"] += len(calls)
        messages = [_tool_message(call) for call in calls]
        messages[0]["content"] = (
            f"Error: the episode's {self.cfg.max_tool_calls} tool calls are spent, so this call "
            "was not run; answer without calling tools."
        )
        for message in messages[1:]:
            message["content"] = "Error: not run (the tool calls are spent)."
        return messages

    def _answer(self, call: ToolCall, outcome: Outcome, stats: ToolStats) -> tuple[str | None, str]:
        """What a call that ran came to: its error kind (None when it worked) and the text the
        model is told; its run time counted in ``stats``."""
        name, cap = call.name, self.cfg.max_output_chars
        if outcome.status == "timeout":
            return "timeout", (
                f"Error: {name!r} did not finish within {self.cfg.tool_timeout_s:g} s and was "
                "stopped."
            )
        if outcome.status != "ok":
            return "crashed", f"Error: {name!r} crashed: {(outcome.error or '')[:cap]}"
        result = outcome.value
        per_tool = stats.per_tool[name]
        per_tool.ran += 1
        per_tool.seconds += result["seconds"]
        if result["status"] == "raised":
            return "raised", f"Error: {name!r} raised {result['output']}"
        if result["status"] == "bad_return":
            return "bad_return", (
                f"Error: {name!r} returned a {result['output']}, not text (a tool must return "
                "a str)."
            )
        if result["status"] == "too_long":
            return "too_long", (
                f"Error: the output of {name!r} was {result['length']} characters, over the "
                f"limit of {cap}; its first {cap} characters:\n{result['output']}"
            )
        return None, result["output"]

    def _trajectory(self, log: MessageLog) -> list[dict[str, Any]]:
        """The conversation as reward functions get it: text fields only, each assistant turn
        with the calls read from it (numbered as the environment numbered them)."""
        out, calls_so_far = [], 0
        for message in log:
            kept = {
                k: message[k]
                for k in ("role", "content", "tool_call_id", "name", "tool_calls")
                if k in message
            }  # type: ignore[literal-required]
            if message["role"] == "assistant" and "tool_calls" not in message:
                turn = parse_tool_calls(message["content"], self.cfg.parser, calls_so_far)
                calls_so_far += len(turn.calls)
                readable = [c.as_message_call() for c in turn.calls if c.error is None]
                if readable:
                    kept["tool_calls"] = readable
            out.append(kept)
        return out

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        check_required_metadata(self, metadata)  # a missing column is no 0 reward
        n = len(message_log_batch)
        stats = ToolStats()  # this step's; added to the environment's once counted
        states = [
            {"turns": 0, "calls": 0, "errors": 0, **((m or {}).get(STATE_KEY) or {})}
            for m in metadata
        ]
        # Each sample's reply: a list of tool messages, or None when its episode ends now.
        replies: list[list[Message] | None] = [None] * n
        jobs: list[tuple] = []
        ran: list[tuple[int, int, ToolCall, Mapping[str, Tool]]] = []  # (sample, reply, call)
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True)):
            state = states[i]
            state["turns"] += 1
            turn = parse_tool_calls(last_assistant_text(log), self.cfg.parser, state["calls"])
            if not turn.calls or state["calls"] >= self.cfg.max_tool_calls:
                continue  # the final answer
            offered = self._offered(meta, i)
            replies[i] = []
            for j, call in enumerate(turn.calls):
                if state["calls"] >= self.cfg.max_tool_calls:
                    replies[i].extend(self._over_budget(turn.calls[j:], offered, stats, state))
                    break
                refusal = self._refusal(call, offered)
                state["calls"] += 1
                message = _tool_message(call)
                replies[i].append(message)
                if refusal is not None:
                    kind, message["content"] = refusal
                    stats.count(call, offered, kind)
                    state["errors"] += 1
                    continue
                tool = offered[call.name]
                jobs.append((tool.function, call.arguments, tool.kwargs, self.cfg.max_output_chars))
                ran.append((i, len(replies[i]) - 1, call, offered))
        for (i, k, call, offered), outcome in zip(ran, self._pool.map(jobs), strict=True):
            kind, text = self._answer(call, outcome, stats)
            replies[i][k]["content"] = text  # type: ignore[index]
            stats.count(call, offered, kind)
            states[i]["errors"] += kind is not None
        for i in range(n):
            if replies[i] is None:  # the episode ends now
                stats.episodes += 1
                stats.episode_turns += states[i]["turns"]
                stats.episode_calls += states[i]["calls"]
        with self._stats_lock:  # before scoring, which may stop the run
            self.stats.add(stats)
        return self._finish(message_log_batch, metadata, states, replies)

    def _finish(
        self,
        logs: list[MessageLog],
        metadata: list[dict[str, Any]],
        states: list[dict[str, int]],
        replies: list[list[Message] | None],
    ) -> EnvironmentReturn:
        """Score the episodes that end now; the others go on with their tool messages."""
        n = len(logs)
        ending = [i for i in range(n) if replies[i] is None]
        scored = None
        if ending:
            columns = [
                {
                    **{k: v for k, v in (metadata[i] or {}).items() if k != STATE_KEY},
                    "trajectory": self._trajectory(logs[i]),
                    "tool_calls": states[i]["calls"],
                    "tool_errors": states[i]["errors"],
                }
                for i in ending
            ]
            scored = self._rewards.step([logs[i] for i in ending], columns)
        names = tuple(str(f.name) for f in self.cfg.functions)
        rewards = torch.zeros(n, dtype=torch.float32)
        components = torch.zeros(n, len(names), dtype=torch.float32)
        observations: list[Any] = list(replies)
        answers: list[str | None] = [
            None if r is None else f"{len(r)} tool call(s)" for r in replies
        ]
        if scored is not None:
            for j, i in enumerate(ending):
                rewards[i] = scored.rewards[j]
                observations[i] = scored.observations[j]
                answers[i] = scored.answers[j]
                if scored.reward_components is not None:
                    components[i] = scored.reward_components.values[j]
        return EnvironmentReturn(
            observations=observations,
            metadata=[{**(m or {}), STATE_KEY: s} for m, s in zip(metadata, states, strict=True)],
            next_stop_strings=[None] * n,
            rewards=rewards,
            terminateds=torch.tensor([r is None for r in replies], dtype=torch.bool),
            answers=answers,
            reward_components=RewardComponents(
                names, tuple(f.weight for f in self.cfg.functions), components
            ),
        )

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        batch, metrics = self._rewards.global_post_process_and_metrics(batch)
        with self._stats_lock:
            tool_metrics = self.stats.take()
        return batch, {**metrics, **tool_metrics}

    def shutdown(self) -> None:
        self._pool.shutdown()
        self._rewards.shutdown()
