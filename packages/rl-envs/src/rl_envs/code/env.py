"""Code environment: the reward is the fraction of the sample's tests its program passes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

from rl_data.types import MessageLog
from rl_envs.code.sandbox import SandboxLimits
from rl_envs.interfaces import last_assistant_text
from rl_envs.verifier_env import VerifierEnvConfig, VerifierEnvironment


class CodeEnvConfig(VerifierEnvConfig):
    sandbox: SandboxLimits = SandboxLimits()
    timeout_s: float = 30.0

    @model_validator(mode="after")
    def _timeout_covers_the_sandbox(self) -> CodeEnvConfig:
        # The pool's timeout is the backstop for the sandbox's own wall-time limit.
        if self.timeout_s <= self.sandbox.wall_time_s:
            raise ValueError(
                f"timeout_s ({self.timeout_s}) must exceed sandbox.wall_time_s "
                f"({self.sandbox.wall_time_s}), which bounds each program"
            )
        return self


class CodeEnvironment(VerifierEnvironment):
    """Metadata per sample: ``{"tests": ["assert f(1) == 2", ...]}``."""

    verifier = "rl_envs.verifiers:score_code"

    def __init__(self, cfg: CodeEnvConfig) -> None:
        super().__init__(cfg)
        self.cfg: CodeEnvConfig = cfg

    def verifier_args(self, message_log: MessageLog, metadata: Mapping[str, Any]) -> tuple:
        tests = metadata["tests"]
        if not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"'tests' must be a non-empty list of strings, got {tests!r}")
        return last_assistant_text(message_log), list(tests), self.cfg.sandbox.model_dump()
