"""Code environment: the reward is the fraction of the sample's test cases its program passes.

Metadata per sample: ``{"tests": [case, ...]}``, each case either ``{"stdin": "1 2\\n",
"stdout": "3\\n"}`` or ``{"function": "add", "args": [1, 2], "expected": 3}`` (see
:mod:`rl_envs.code.cases`). The program runs in a sandbox (:mod:`rl_envs.code.sandbox`) and
only produces outputs; the comparison happens in the verifier process.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from rl_data.types import MessageLog
from rl_envs.code.cases import parse_cases
from rl_envs.code.sandbox import SandboxLimits, require_isolation
from rl_envs.interfaces import EnvironmentReturn, last_assistant_text
from rl_envs.verifier_env import VerifierEnvConfig, VerifierEnvironment

logger = logging.getLogger(__name__)


class CodeEnvConfig(VerifierEnvConfig):
    sandbox: SandboxLimits = SandboxLimits()
    timeout_s: float = 30.0
    # One program a call: runs are slow and uneven, and balance best handed to whichever
    # worker is free (a call's own cost is small beside them).
    chunk_size: int | None = Field(1, ge=1)

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
    verifier = "rl_envs.verifiers:score_code"

    def __init__(self, cfg: CodeEnvConfig) -> None:
        # Refuse at setup, not per sample, when model code could not be isolated here.
        isolation = require_isolation(cfg.sandbox)
        self.isolated = isolation.bwrap is not None
        if not self.isolated:
            logger.warning(
                "CodeEnvironment runs model-written code UNISOLATED (allow_unisolated: true): %s",
                isolation.why_not,
            )
        super().__init__(cfg)
        self.cfg: CodeEnvConfig = cfg

    def verifier_args(self, message_log: MessageLog, metadata: Mapping[str, Any]) -> tuple:
        cases = parse_cases(metadata["tests"])  # a bad case is this sample's error, found here
        return (
            last_assistant_text(message_log),
            [c.model_dump() for c in cases],
            self.cfg.sandbox.model_dump(),
        )

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        out = super().step(message_log_batch, metadata)
        # Every result says whether the code that earned it was isolated.
        marked = [{**(m or {}), "sandbox_isolated": self.isolated} for m in out.metadata]
        return out._replace(metadata=marked)
