"""The OpenAI-compatible endpoint agent programs are trained through (``EndpointServer``).

A FastAPI app served by uvicorn on 127.0.0.1, on a free port, in a background thread of the
run. Each episode has its own base URL, ``http://127.0.0.1:PORT/episodes/<id>/v1``, so a
plain ``openai.OpenAI(base_url=..., api_key="x")`` client works unchanged and every request
is recorded into its episode's ``Trajectory``:

- ``POST .../chat/completions``: ``messages``, ``tools`` (parsed back out of the generated
  text by ``rl_envs.tools.parsers`` into ``tool_calls``), ``max_tokens`` /
  ``max_completion_tokens`` (the response is cut there: the first k sampled tokens are
  sampled the same whatever the limit), ``stop``; ``temperature`` and ``top_p`` only at the
  run's values (the loss scores tokens under the distribution they were sampled from); ``n``
  1 only; ``stream`` refused;
- ``POST .../completions``: one ``prompt`` string, the same options.

A body larger than ``agent_program.max_request_bytes`` is refused with a 413.

The response is OpenAI's, plus ``token_ids`` on each choice: the sampled ids, the very ids
the trajectory trains on. Its text is the text of exactly those ids.

Requests are not generated one by one: they wait in a ``GenerationBatcher``, and whenever the
generator is free every waiting request (of every episode) goes into one ``generate`` call,
as the agent loop batches its episodes' turns.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from rl_algorithms.agent_programs.trajectories import Refused, Sample, Trajectory
from rl_algorithms.episodes import generation_input, token_versions
from rl_envs.tools.parsers import parse_tool_calls
from rl_models.generation.interfaces import GenerationInterface


@dataclass
class _Waiting:
    prompt: torch.Tensor
    stops: list[str] | None
    future: Future = field(default_factory=Future)


class GenerationBatcher:
    """Requests wait here; a thread of its own hands every waiting one to the generator in one
    ``generate`` call whenever the previous call has returned. The generator's first failure
    fails every request of its call and every later one, and completes ``failed`` (the
    rollout stops on it: see ``programs.run_program_rollouts``)."""

    def __init__(
        self,
        generation: GenerationInterface,
        pad_id: int,
        greedy: bool,
        expected_weight_version: int | None,
    ) -> None:
        self.generation, self.pad_id = generation, pad_id
        self.greedy, self.expected_weight_version = greedy, expected_weight_version
        self.condition = threading.Condition()
        self.waiting: list[_Waiting] = []
        self.closed = False
        self.failed: Future = Future()  # gets the generator's failure: the run's, raised
        self.call_sizes: list[int] = []
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._serve, name="agent-endpoint-gen", daemon=True)
        self.thread.start()

    @property
    def error(self) -> BaseException | None:
        return self.failed.exception() if self.failed.done() else None

    def submit(self, prompt: torch.Tensor, stops: list[str] | None) -> Future:
        waiting = _Waiting(prompt, stops)
        with self.condition:
            if self.closed or self.failed.done():
                raise Refused("the rollout this episode belongs to is over", status=400)
            self.waiting.append(waiting)
            self.condition.notify()
        return waiting.future

    def close(self) -> None:
        """No more requests; those still waiting are refused (their episodes are over)."""
        with self.condition:
            self.closed = True
            left, self.waiting = self.waiting, []
            self.condition.notify()
        for w in left:
            w.future.set_exception(Refused("the rollout this episode belongs to is over"))
        self.thread.join(timeout=60)

    def _serve(self) -> None:
        while True:
            with self.condition:
                while not self.waiting and not self.closed:
                    self.condition.wait()
                if not self.waiting:
                    return
                batch, self.waiting = self.waiting, []
            self._generate(batch)

    def _generate(self, batch: list[_Waiting]) -> None:
        started = time.monotonic()
        try:
            if self.failed.done():
                raise self.failed.exception()  # type: ignore[misc]
            data = generation_input(
                [[{"token_ids": w.prompt}] for w in batch],  # type: ignore[misc]
                [w.stops for w in batch],
                self.pad_id,
            )
            out = self.generation.generate(
                data, greedy=self.greedy, expected_weight_version=self.expected_weight_version
            )
            # The weights that sampled each row, as the streaming engines report them; a
            # generator that reports none was not refitted during its (synchronous) call.
            version = None if "weight_version_min" in out else int(self.generation.weight_version)
        except BaseException as e:  # every request of the call fails with it; the run raises it
            if not self.failed.done():
                self.failed.set_exception(e)
            for w in batch:
                w.future.set_exception(e)
            return
        self.seconds += time.monotonic() - started
        self.call_sizes.append(len(batch))
        for row, w in enumerate(batch):
            start, n = len(w.prompt), int(out["generation_lengths"][row])
            versions = token_versions(out, row, start, n)
            w.future.set_result(
                Sample(
                    out["output_ids"][row, start : start + n].to(torch.long),
                    out["logprobs"][row, start : start + n].to(torch.float32),
                    bool(out["truncated"][row]),
                    int(out["weight_version_min"][row]) if version is None else version,
                    versions,
                    int(out["weight_version_max"][row]) if "weight_version_max" in out else None,
                )
            )


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat and completion requests that the endpoint reads; any other
    field (``model``, ``seed``, ``user``...) is accepted and has no effect."""

    model_config = ConfigDict(extra="allow")

    messages: list[Any] | None = None
    prompt: Any = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    stream: bool | None = None
    stop: str | list[str] | None = None


@dataclass
class Episode:
    """A registered episode: its trajectory, the rollout's generator queue and settings."""

    trajectory: Trajectory
    batcher: GenerationBatcher
    temperature: float
    top_p: float
    tool_call_parser: str
    max_request_bytes: int  # a larger body is refused with a 413


def _sampling_problem(request: ChatRequest, episode: Episode) -> str | None:
    """Why the request asks for sampling the run does not do, if it does."""
    if request.stream:
        return "stream: true is not supported; send the request without streaming"
    if request.n not in (None, 1):
        return f"n must be 1 (got {request.n}): send one request per sample"
    if request.tool_choice not in (None, "auto", "none"):
        return f"tool_choice {request.tool_choice!r} is not supported (only auto and none)"
    for name, asked, run in (
        ("temperature", request.temperature, episode.temperature),
        ("top_p", request.top_p, episode.top_p),
    ):
        if asked is not None and asked != run:
            return (
                f"{name} {asked} differs from the run's ({run}, generation.sampling.{name}): "
                "tokens are trained under the distribution they were sampled from; leave "
                f"{name} out or send {run}"
            )
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(request, name)
        if value is not None and value < 1:
            return f"{name} must be at least 1, got {value}"
    return None


def _completion_limit(request: ChatRequest) -> int | None:
    """The most tokens the reply may have: ``max_completion_tokens`` (OpenAI's newer name)
    where given, else ``max_tokens``."""
    if request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


async def _body(request: Request, max_bytes: int) -> bytes:
    """The request's body, refused with a 413 once it is larger than ``max_bytes`` (read in
    chunks: a body sent without a Content-Length is cut there too, not held whole)."""
    too_large = Refused(
        f"the request body is larger than {max_bytes} bytes "
        "(agent_program.max_request_bytes): send a shorter conversation, or raise the limit",
        status=413,
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _parsed(body: bytes) -> ChatRequest:
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)
        raise Refused(f"invalid request: {errors}") from None


def _error(message: str, status: int) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return JSONResponse(body, status_code=status)


def _assistant_reply(text: str, tools: bool, parser: str) -> tuple[dict[str, Any], bool]:
    """The generated text as OpenAI's assistant message: with ``tools`` offered, its calls as
    ``tool_calls`` and the rest as ``content`` (a turn with a call that cannot be read keeps
    its whole text as content, with no calls); whether it holds calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if not tools:
        return message, False
    turn = parse_tool_calls(text, parser)
    if not turn.calls or any(c.error is not None for c in turn.calls):
        return message, False
    message["content"] = turn.text if turn.text.strip() else None
    message["tool_calls"] = [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in turn.calls
    ]
    return message, True


class EndpointServer:
    """The endpoint (see the module docstring), serving from construction until ``close``."""

    def __init__(self) -> None:
        self.episodes: dict[str, Episode] = {}
        self.ended: set[str] = set()  # episodes whose rollout is over
        self.late_requests = 0  # requests for those
        self.lock = threading.Lock()
        self.app = self._app()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="agent-endpoint", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on port {self.port}")
            time.sleep(0.01)

    def base_url(self, episode_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode_id}/v1"

    def new_episode_id(self) -> str:
        return uuid.uuid4().hex[:16]

    def register(self, episode: Episode) -> None:
        with self.lock:
            self.episodes[episode.trajectory.episode_id] = episode

    def unregister(self, episode_ids: Sequence[str]) -> None:
        with self.lock:
            for i in episode_ids:
                self.episodes.pop(i, None)
                self.ended.add(i)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def _episode(self, episode_id: str) -> Episode:
        with self.lock:
            episode = self.episodes.get(episode_id)
            if episode is None and episode_id in self.ended:
                self.late_requests += 1
                raise Refused(f"episode {episode_id} has ended: its rollout is over")
        if episode is None:
            raise Refused(f"no episode {episode_id}", status=404)
        return episode

    def _app(self) -> FastAPI:
        app = FastAPI(title="rl agent endpoint")

        @app.exception_handler(Refused)
        async def refused(_: Request, e: Refused) -> JSONResponse:
            return _error(str(e), e.status)

        @app.post("/episodes/{episode_id}/v1/chat/completions")
        async def chat(episode_id: str, request: Request) -> dict[str, Any]:
            return await self._complete(episode_id, request, chat=True)

        @app.post("/episodes/{episode_id}/v1/completions")
        async def completions(episode_id: str, request: Request) -> dict[str, Any]:
            return await self._complete(episode_id, request, chat=False)

        return app

    async def _complete(self, episode_id: str, http: Request, chat: bool) -> dict[str, Any]:
        """One request, answered. The event loop serves every episode's requests, so what
        takes time in proportion to a request (parsing its body, the chat template, the
        tokenizer) runs on the threadpool; the loop only reads bodies, capped in size."""
        episode = self._episode(episode_id)
        trajectory = episode.trajectory
        request = await run_in_threadpool(_parsed, await _body(http, episode.max_request_bytes))
        problem = _sampling_problem(request, episode)
        if problem is not None:
            raise Refused(problem)
        tools = request.tools if request.tool_choice != "none" else None
        if chat:
            prompt = await run_in_threadpool(trajectory.open_chat, request.messages, request.tools)
        else:
            prompt = await run_in_threadpool(trajectory.open_completion, request.prompt)
        stops = [request.stop] if isinstance(request.stop, str) else request.stop
        try:
            sample: Sample = await asyncio.wrap_future(episode.batcher.submit(prompt, stops))
        except BaseException as e:
            trajectory.cancel_request()
            if isinstance(e, Exception) and not isinstance(e, Refused):
                # The generator failed, or the group this episode belongs to was cancelled
                # (async GRPO): the program is told, in OpenAI's error form, and its episode
                # is stopped.
                raise Refused(
                    f"episode {episode_id}: no reply was generated, the episode is stopped "
                    f"({type(e).__name__}: {e})"
                ) from e
            raise
        limit = _completion_limit(request)
        if limit is not None:
            sample = sample.cut(limit)
        replies: list[tuple[dict[str, Any], bool]] = []

        def reply_of(text: str) -> dict[str, Any]:
            replies.append(_assistant_reply(text, bool(tools), episode.tool_call_parser))
            return replies[-1][0]

        logged = await run_in_threadpool(
            trajectory.close_request, prompt, sample, reply_of if chat else None
        )
        sampled = logged["token_ids"][logged["token_loss_mask"].bool()]  # cut to the room left
        truncated = sample.truncated or len(sampled) < len(sample.ids)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(sampled),
            "total_tokens": len(prompt) + len(sampled),
        }
        base = {"id": f"rl-{uuid.uuid4().hex[:12]}", "created": int(time.time()), "model": "policy"}
        if not chat:
            choice = {"index": 0, "text": logged["content"], "logprobs": None}
            reason = "length" if truncated else "stop"
            return {
                **base,
                "object": "text_completion",
                "choices": [{**choice, "finish_reason": reason, "token_ids": sampled.tolist()}],
                "usage": usage,
            }
        reply, calls = replies[-1]
        reason = "length" if truncated else "tool_calls" if calls else "stop"
        choice = {"index": 0, "message": reply, "finish_reason": reason, "logprobs": None}
        return {
            **base,
            "object": "chat.completion",
            "choices": [{**choice, "token_ids": sampled.tolist()}],
            "usage": usage,
        }
