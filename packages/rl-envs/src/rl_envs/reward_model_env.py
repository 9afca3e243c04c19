"""Rewards from a trained sequence-classifier reward model (one logit per conversation).

The model is a local Hugging Face directory holding an ``AutoModelForSequenceClassification``
with ``num_labels=1`` and its tokenizer. Conversations are written out with the tokenizer's chat
template when it has one, else as ``"role: content"`` lines, and scored in batches. On a GPU
machine start it with ``RewardModelEnvironment.as_actor(cfg, num_gpus=1)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch

from rl_data.types import MessageLog
from rl_distributed.config import ConfigModel
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn
from rl_envs.metrics import OutcomeCounts, reward_metrics

logger = logging.getLogger(__name__)


class RewardModelEnvConfig(ConfigModel):
    model_path: str
    batch_size: int = 8
    max_length: int = 4096  # longer conversations keep their first max_length tokens
    device: str = "auto"  # "auto": cuda when there is one
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    success_threshold: float = 0.0  # score at which a response counts towards "accuracy"


def conversation_text(tokenizer: Any, message_log: MessageLog) -> str:
    messages = [{"role": m["role"], "content": m["content"]} for m in message_log]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


class RewardModelEnvironment(EnvironmentInterface):
    def __init__(self, cfg: RewardModelEnvConfig) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg = cfg
        self.counts = OutcomeCounts()
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            cfg.model_path, dtype=getattr(torch, cfg.dtype)
        ).to(self.device)
        self.model.eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"a reward model has one label, {cfg.model_path} has {self.model.config.num_labels}"
            )
        # Batches are padded; the model scores each sequence at its last non-padding token,
        # which it can only find when it knows the padding id.
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"

    @torch.no_grad()
    def score(self, texts: list[str]) -> torch.Tensor:
        """One float score per text, batched ``cfg.batch_size`` at a time."""
        scores = []
        for i in range(0, len(texts), self.cfg.batch_size):
            enc = self.tokenizer(
                texts[i : i + self.cfg.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.cfg.max_length,
            ).to(self.device)
            scores.append(self.model(**enc).logits[:, 0].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        n = len(message_log_batch)
        try:
            rewards = self.score(
                [conversation_text(self.tokenizer, log) for log in message_log_batch]
            )
            status = "ok"
        except Exception:  # e.g. out of memory: this batch goes unscored, the run goes on
            logger.exception("reward model failed on a batch of %d", n)
            rewards, status = torch.zeros(n), "error"
        for _ in range(n):
            self.counts.add(status)
        return EnvironmentReturn(
            observations=[
                {"role": "environment", "content": f"reward {r:g}"} for r in rewards.tolist()
            ],
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=rewards.to(torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=[None] * n,
        )

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        metrics = reward_metrics(
            batch["rewards"], batch.get("group_ids"), success_threshold=self.cfg.success_threshold
        )
        return batch, {**metrics, **self.counts.take()}
