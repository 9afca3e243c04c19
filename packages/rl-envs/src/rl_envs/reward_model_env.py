"""Rewards from a trained sequence-classifier reward model (one logit per conversation).

The model is a local Hugging Face directory holding an ``AutoModelForSequenceClassification``
with ``num_labels=1`` and its tokenizer. Conversations are written out with the tokenizer's chat
template when it has one (whose text already holds its special tokens, so none are added again),
else as ``"role: content"`` lines (with the tokenizer's own special tokens), and scored in
batches. A conversation over ``max_length`` tokens keeps its *last* ``max_length``: the model
reads its score at the end of the response, so the start of the prompt is what goes. On a GPU
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
    # A local reward model directory (a sequence-classification model, e.g. one trained by rl rm).
    model_path: str
    # Conversations scored per forward pass.
    batch_size: int = 8
    max_length: int = 4096  # longer conversations keep their last max_length tokens
    device: str = "auto"  # "auto": cuda when there is one
    # The reward model's dtype.
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    success_threshold: float = 0.0  # score at which a response counts towards "accuracy"


def conversation_text(tokenizer: Any, message_log: MessageLog) -> tuple[str, bool]:
    """The conversation as text, and whether a chat template rendered it."""
    messages = [{"role": m["role"], "content": m["content"]} for m in message_log]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False), True
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages), False


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

    def encode(self, message_log: MessageLog) -> list[int]:
        """Token ids of one conversation, special tokens once, at most ``max_length`` (the end)."""
        text, templated = conversation_text(self.tokenizer, message_log)
        ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
        return ids[-self.cfg.max_length :]

    @torch.no_grad()
    def score(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One float score per sequence, batched ``cfg.batch_size`` at a time."""
        scores = []
        for i in range(0, len(token_ids), self.cfg.batch_size):
            batch = self.tokenizer.pad(
                {"input_ids": token_ids[i : i + self.cfg.batch_size]}, return_tensors="pt"
            ).to(self.device)
            scores.append(self.model(**batch).logits[:, 0].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        n = len(message_log_batch)
        try:
            rewards = self.score([self.encode(log) for log in message_log_batch])
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
