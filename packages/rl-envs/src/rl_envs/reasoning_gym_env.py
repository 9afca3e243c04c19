"""Any reasoning-gym task, scored by that task's own scorer against the entry kept with the prompt.

Metadata per sample, either the entry itself (what ``dataset[i]`` returned; its
``metadata.source_dataset`` names the task)::

    {"entry": {"question": ..., "answer": ..., "metadata": {"source_dataset": "leg_counting", ...}}}

or how to rebuild it, which keeps the metadata small::

    {"dataset": "leg_counting", "seed": 42, "size": 1000, "index": 17}

The answer is taken from the response's last ``<answer>...</answer>`` (``answer_tag``); no tag
means no answer, which every scorer gives 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_data.types import MessageLog
from rl_envs.interfaces import last_assistant_text
from rl_envs.verifier_env import VerifierEnvConfig, VerifierEnvironment


class ReasoningGymEnvConfig(VerifierEnvConfig):
    answer_tag: str | None = "answer"  # None: score the whole response


class ReasoningGymEnvironment(VerifierEnvironment):
    preload = ("reasoning_gym",)
    verifier = "rl_envs.verifiers:score_reasoning_gym"

    def __init__(self, cfg: ReasoningGymEnvConfig) -> None:
        super().__init__(cfg)
        self.cfg: ReasoningGymEnvConfig = cfg

    def verifier_args(self, message_log: MessageLog, metadata: Mapping[str, Any]) -> tuple:
        if "entry" not in metadata and not {"dataset", "seed", "size", "index"} <= metadata.keys():
            raise KeyError("metadata needs 'entry' or 'dataset', 'seed', 'size' and 'index'")
        return last_assistant_text(message_log), dict(metadata), self.cfg.answer_tag
