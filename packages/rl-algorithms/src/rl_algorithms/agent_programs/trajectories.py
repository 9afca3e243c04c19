"""One episode of an agent program, recorded request by request into one trainable
trajectory (``Trajectory``).

An agent program talks to the endpoint as to any OpenAI-style server: each request sends the
whole conversation so far. The trajectory keeps that conversation twice: as the agent sees it
(``conversation``: OpenAI messages, normalised, the assistant turns exactly as they were
returned) and as token ids (``log``: a message log as the rollouts keep theirs). A request
must *extend* the previous one: the previous request's messages, then the assistant message
returned for it, then new messages (tool results, a user turn). Only those new messages are
tokenised (by the chat template, with loss mask 0, as ``Episodes.continue_with`` tokenises an
environment's reply); the assistant turns stay exactly the sampled ids, with their log-probs
(``episodes.assistant_message``: token in, token out). A request that does not extend the
previous one is refused and the episode fails: a trajectory is never patched together from
conversations that disagree.

How an episode ends: its program returns (``RETURNED``) or fails (``FAILED_*``: those samples
stay out of the loss, see ``RolloutResult.sample_mask``); a limit it reached on the way
(``REQUEST_LIMIT``, ``TOKEN_LIMIT``) refuses its further requests but keeps the episode
trainable if the program still returns.

A request changes its episode all at once or not at all: its new messages join the log only
with the answer sampled for them. A request refused or left unanswered (a template that
cannot render it, no room left, a generator failure) leaves the episode as it was, its log
ending in its last answer: a refusal that is the program's fault fails the episode
(``FAILED_DIVERGED``), any other keeps it trainable on what it recorded.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from rl_algorithms.episodes import TOKEN_LIMIT, assistant_message
from rl_algorithms.rollout_result import AGENT_FAILED_PREFIX
from rl_data.errors import TemplateError
from rl_data.messages import tokenize_message_logs
from rl_data.templates import ChatTemplate, Tools
from rl_data.tokenizers import encode_texts
from rl_data.types import MessageLog

RETURNED = "agent_returned"
REQUEST_LIMIT = "agent_request_limit"
FAILED_NO_REQUESTS = AGENT_FAILED_PREFIX + "no_requests"
FAILED_TIMEOUT = AGENT_FAILED_PREFIX + "timeout"
FAILED_ERROR = AGENT_FAILED_PREFIX + "error"
FAILED_DIVERGED = AGENT_FAILED_PREFIX + "diverged"
FAILED_LATE_REQUEST = AGENT_FAILED_PREFIX + "late_request"
FAILURES = (
    FAILED_NO_REQUESTS,
    FAILED_TIMEOUT,
    FAILED_ERROR,
    FAILED_DIVERGED,
    FAILED_LATE_REQUEST,
)

ROLES = ("system", "user", "assistant", "tool")


class Refused(Exception):
    """A request the endpoint answers with HTTP ``status`` and ``message`` (OpenAI's error
    body), not a generation."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class _Pending:
    """An open request: the episode as it will be once its answer is recorded (the log with
    its new messages tokenised, the conversation the agent sent, the tools, the completion
    text); until then the episode keeps what it had."""

    log: MessageLog
    conversation: list[dict[str, Any]]
    tools: Tools | None
    completion_text: str | None


@dataclass(frozen=True)
class Sample:
    """What the generator sampled for one request: the ids, their log-probs and, where the
    generator reports them (async GRPO's streaming engines), each token's weight version and
    the newest version that took part (a refit may land inside a turn)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    truncated: bool
    weight_version: int  # the oldest weights that sampled any of its tokens
    versions: torch.Tensor | None = None  # per token
    version_max: int | None = None

    def cut(self, n: int) -> Sample:
        """Its first ``n`` tokens (a reply cut at a limit is truncated)."""
        if len(self.ids) <= n:
            return self
        versions = None if self.versions is None else self.versions[:n]
        cut = replace(
            self, ids=self.ids[:n], logprobs=self.logprobs[:n], truncated=True, versions=versions
        )
        if versions is None or len(versions) == 0:
            return cut
        # The versions of the tokens kept: a refit that landed after them took no part.
        return replace(cut, weight_version=int(versions.min()), version_max=int(versions.max()))


@dataclass(frozen=True)
class RequestRecord:
    """What one request sampled: from which tokens, which tokens, with which log-probs, under
    which weights."""

    prompt_ids: torch.Tensor
    sampled_ids: torch.Tensor
    logprobs: torch.Tensor
    weight_version: int
    truncated: bool


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, nothing, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise Refused(f"{where}: content must be a string or a list of text parts, got {content!r}")


def _call(call: Any, where: str) -> dict[str, Any]:
    """A tool call as the chat templates read it: arguments as an object (OpenAI sends them
    as a JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Refused(f"{where}: a tool call needs function.name, got {call!r}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else kept, and compared, as sent
            arguments = json.loads(arguments) if arguments.strip() else {}
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def normalized_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages as plain messages (role, text content, and ``tool_calls``,
    ``tool_call_id``, ``name`` where given), in the form the chat templates render and
    conversations are compared in; a ``Refused`` naming the message that is not one."""
    if not isinstance(messages, list) or not messages:
        raise Refused("messages must be a non-empty list of chat messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise Refused(f"{where}: role must be one of {list(ROLES)}, got {role!r}")
        plain: dict[str, Any] = {
            "role": message["role"],
            "content": _text(message.get("content"), where),
        }
        calls = message.get("tool_calls")
        if calls and not isinstance(calls, list):
            raise Refused(f"{where}.tool_calls must be a list, got {type(calls).__name__}")
        if calls:
            plain["tool_calls"] = [
                _call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                plain[key] = str(message[key])
        out.append(plain)
    return out


def _difference(sent: list[dict[str, Any]], expected: list[dict[str, Any]]) -> str:
    """Where a request's conversation parts from the one the episode holds, said plainly."""
    if len(sent) <= len(expected):
        return (
            f"it has {len(sent)} messages, the episode's conversation so far has "
            f"{len(expected)} (the previous request's and the reply to it), each to be sent "
            "again, then new ones"
        )
    i = next(i for i, (a, b) in enumerate(zip(sent, expected, strict=False)) if a != b)
    return f"messages[{i}] is {sent[i]!r}, but the episode's conversation has {expected[i]!r}"


class Trajectory:
    """One episode's requests joined into one conversation of token ids (see the module
    docstring). Its methods are called from the endpoint's threads: every change holds
    ``lock``."""

    def __init__(
        self,
        episode_id: str,
        tokenizer: Any,
        template: ChatTemplate,
        max_seq_len: int,
        max_requests: int,
    ) -> None:
        self.episode_id = episode_id
        self.tokenizer, self.template = tokenizer, template
        self.max_seq_len, self.max_requests = max_seq_len, max_requests
        self.lock = threading.Lock()
        self.conversation: list[dict[str, Any]] = []  # as the agent sees it
        self.completion_text: str | None = None  # /v1/completions: the prompt and replies
        self.log: MessageLog = []  # as token ids
        self.tools: Tools | None = None
        self.requests: list[RequestRecord] = []
        self.pending: _Pending | None = None  # the request in flight
        self.limit: str | None = None  # a limit reached: later requests are refused
        self.failure: str | None = None
        self.ended = False
        self.late_requests = 0
        self.template_mismatches = 0

    @property
    def end_reason(self) -> str:
        return self.failure or self.limit or RETURNED

    def fail(self, reason: str) -> None:
        """The episode failed (the first failure is kept): out of the loss."""
        with self.lock:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason

    def end(self) -> None:
        """The program is done (returned, raised, or cut at its deadline): later requests are
        late."""
        with self.lock:
            self.ended = True
            if not self.requests:
                self._fail(FAILED_NO_REQUESTS)

    def _admit(self) -> None:
        """Refuse a request the episode cannot take now (called under ``lock``)."""
        if self.ended:
            self.late_requests += 1
            self._fail(FAILED_LATE_REQUEST)
            raise Refused(
                f"episode {self.episode_id} has ended ({self.end_reason}): its program must "
                "not call the endpoint once it has returned or passed its deadline"
            )
        if self.failure is not None:
            raise Refused(f"episode {self.episode_id} has failed ({self.failure})")
        if self.pending is not None:
            self._fail(FAILED_DIVERGED)
            raise Refused(
                f"episode {self.episode_id} already has a request in flight: an episode is one "
                "conversation, its requests one after the other"
            )
        if self.limit is not None:
            raise Refused(f"episode {self.episode_id} reached a limit ({self.limit})")
        if len(self.requests) >= self.max_requests:
            self.limit = REQUEST_LIMIT
            raise Refused(
                f"episode {self.episode_id} made its {self.max_requests} requests "
                "(agent_program.max_requests_per_episode)"
            )

    def open_chat(self, messages: Any, tools: Tools | None) -> torch.Tensor:
        """A chat request's prompt as token ids (the conversation so far, extended by the
        request's new messages and the assistant header); refused when it does not extend it.
        Nothing of the request is kept until ``close_request`` records its answer."""
        with self.lock:
            self._admit()
            sent = normalized_messages(messages)
            if self.completion_text is not None:
                self._diverged("it is a chat request in an episode of /v1/completions requests")
            if not self.requests:
                tools = tools or None
                log: MessageLog = [dict(m) for m in sent]  # type: ignore[misc]
            else:
                if (tools or None) != self.tools:
                    self._diverged("it offers other tools than the episode's first request")
                tools, known = self.tools, self.conversation
                if sent[: len(known)] != known or len(sent) == len(known):
                    self._diverged(_difference(sent, known))
                log = [*self.log, *(dict(m) for m in sent[len(known) :])]  # type: ignore[misc]
            try:
                tokenize_message_logs(
                    [log], self.tokenizer, self.template, add_generation_prompt=True, tools=[tools]
                )
            except TemplateError as e:
                # The episode is as it was: the program may send a request the template takes.
                raise Refused(
                    f"episode {self.episode_id}: the chat template cannot render the request's "
                    f"messages: {e}"
                ) from e
            return self._open(_Pending(log, sent, tools, None))

    def open_completion(self, prompt: Any) -> torch.Tensor:
        """A completion request's prompt as token ids: the episode's text so far (sampled ids
        as they are) and the new text after it, tokenised with loss mask 0."""
        with self.lock:
            self._admit()
            if not isinstance(prompt, str) or not prompt:
                raise Refused("prompt must be a non-empty string (one prompt per request)")
            if self.conversation:
                self._diverged("it is a completion request in an episode of chat requests")
            known = self.completion_text or ""
            if not prompt.startswith(known) or (self.requests and prompt == known):
                self._diverged(
                    "its prompt does not start with the previous prompt followed by the text "
                    "returned for it, then new text"
                )
            ids = encode_texts(self.tokenizer, [prompt[len(known) :]])[0]
            new = {"role": "user", "content": prompt[len(known) :], "token_ids": torch.tensor(ids)}
            return self._open(_Pending([*self.log, new], [], None, prompt))  # type: ignore[list-item]

    def _diverged(self, why: str) -> None:
        self._fail(FAILED_DIVERGED)
        raise Refused(
            f"episode {self.episode_id}: the request does not extend the episode's conversation "
            f"so far: {why}. An episode is one conversation, each request the previous one's "
            "messages, the reply to it, then new messages; start a new episode for another"
        )

    def _open(self, pending: _Pending) -> torch.Tensor:
        """The request's prompt, held open until its answer; one with no room left to generate
        is refused, and the episode keeps its log as it was: ending in its last answer (a
        trajectory that ends in a question nobody answered would be scored for nothing)."""
        prompt = torch.cat([m["token_ids"] for m in pending.log])
        if len(prompt) >= self.max_seq_len:
            self.limit = TOKEN_LIMIT
            raise Refused(
                f"episode {self.episode_id}: the conversation is {len(prompt)} tokens, no room "
                f"left to generate within max_total_sequence_length ({self.max_seq_len})"
            )
        self.pending = pending
        return prompt

    def close_request(
        self,
        prompt: torch.Tensor,
        sample: Sample,
        reply: Callable[[str], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Record what was sampled for the open request: its new messages and the sampled
        assistant turn (cut to the room left in ``max_total_sequence_length``) join the log
        together, or, if this raises, neither does. ``reply`` turns a chat turn's text into the
        assistant message returned to the agent (OpenAI's form: what its next request must
        repeat). The turn's message as it is logged (``content``: the sampled ids' text;
        ``generation_versions`` where the generator reported them)."""
        with self.lock:
            pending, self.pending = self.pending, None
            if pending is None:
                raise RuntimeError(f"episode {self.episode_id} has no request open")
            if self.ended:  # cut at its deadline while it was generated
                self.late_requests += 1
                raise Refused(f"episode {self.episode_id} ended while its request was generated")
            room = self.max_seq_len - len(prompt)
            limit = self.limit
            if len(sample.ids) > room:
                sample, limit = sample.cut(room), TOKEN_LIMIT
            ids, logprobs = sample.ids, sample.logprobs
            completion_text, conversation = pending.completion_text, pending.conversation
            if completion_text is None:
                message = assistant_message(
                    ids,
                    logprobs,
                    self.tokenizer,
                    self.template,
                    pending.log,
                    room,
                    pending.tools,
                    sample.versions,
                )
                if reply is not None:
                    conversation = [
                        *conversation,
                        *normalized_messages([reply(message["content"])]),
                    ]
            else:  # raw text, no chat template: the sampled ids alone
                content = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
                message = {
                    "role": "assistant",
                    "content": content,
                    "token_ids": ids,
                    "token_loss_mask": torch.ones_like(ids),
                    "generation_logprobs": logprobs,
                }
                if sample.versions is not None:
                    message["generation_versions"] = sample.versions
                completion_text += content
            if sample.version_max is not None:
                message["generation_version_max"] = sample.version_max
            mismatch = bool(message.pop("template_mismatch", False))
            # Nothing above changed the episode; from here on nothing can fail.
            self.log = [*pending.log, message]  # type: ignore[list-item]
            self.conversation, self.completion_text = conversation, completion_text
            self.tools, self.limit = pending.tools, limit
            self.template_mismatches += mismatch
            self.requests.append(
                RequestRecord(prompt, ids, logprobs, sample.weight_version, sample.truncated)
            )
            return message

    def cancel_request(self) -> None:
        """The open request got no answer (the generator failed, or the endpoint could not
        return it): the episode is as it was before it."""
        with self.lock:
            self.pending = None

    @property
    def truncated(self) -> bool:
        return any(r.truncated for r in self.requests) or self.limit == TOKEN_LIMIT
