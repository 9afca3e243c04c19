"""Math answers checked by math-verify: the boxed (or last) answer against the ground truth
(``rl_envs.verifiers.score_math``: an answer to a number must be written as a number)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_data.types import MessageLog
from rl_envs.interfaces import last_assistant_text
from rl_envs.verifier_env import VerifierEnvConfig, VerifierEnvironment


class MathEnvConfig(VerifierEnvConfig):
    pass


class MathEnvironment(VerifierEnvironment):
    """Metadata per sample: ``{"ground_truth": "..."}``."""

    required_metadata = ("ground_truth",)
    preload = ("math_verify",)
    verifier = "rl_envs.verifiers:score_math"

    def verifier_args(self, message_log: MessageLog, metadata: Mapping[str, Any]) -> tuple:
        return last_assistant_text(message_log), metadata["ground_truth"]
