"""``<loop>.agent_program``: the config of rollouts played by an agent program (kept apart
from the endpoint so that reading a config does not import the web server)."""

from __future__ import annotations

import shlex
from typing import Literal

from pydantic import Field, model_validator

from rl_distributed.config import ConfigModel


class AgentProgramConfig(ConfigModel):
    """``<loop>.agent_program``: rollouts played by a program of your own through the
    OpenAI-compatible endpoint (see ``rl_algorithms.agent_programs``)."""

    # The program, a Python function "module:function" or "path/to/file.py:function" called
    # with (base_url, row); or
    function: str | None = None
    # a command (split like a shell would) given OPENAI_BASE_URL and the row as JSON on stdin.
    command: str | None = None
    # An episode's program is cut here (a command is killed); the episode fails. Under async
    # GRPO it must be below grpo.async_grpo.max_group_seconds (300 by default), so that a hung
    # program fails its own episode rather than getting its whole group cancelled and queued
    # again.
    max_episode_seconds: float = Field(240.0, gt=0)
    # Requests after this many are refused (the episode still counts if its program returns).
    max_requests_per_episode: int = Field(32, ge=1)
    max_concurrent_episodes: int = Field(64, ge=1)  # programs running at once
    # A request body larger than this is refused (HTTP 413) before it is parsed: every request
    # sends the whole conversation, and 16 MiB holds one far longer than any context window.
    max_request_bytes: int = Field(16 * 2**20, ge=1024)
    # How tool calls are read back out of generated text into OpenAI tool_calls.
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] = "hermes"
    # The column (reward-function keyword argument) the program's return value is passed in;
    # null: it is not passed.
    result_column: str | None = None

    @model_validator(mode="after")
    def _one_program(self) -> AgentProgramConfig:
        if (self.function is None) == (self.command is None):
            raise ValueError(
                "agent_program: give the program as agent_program.function "
                "('module:function') or agent_program.command, exactly one of them"
            )
        if self.function is not None and ":" not in self.function:
            raise ValueError(
                f"agent_program.function {self.function!r} must be 'module:function' or "
                "'path/to/file.py:function'"
            )
        if self.command is not None and not shlex.split(self.command):
            raise ValueError("agent_program.command is empty")
        return self
