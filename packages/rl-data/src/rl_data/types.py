"""The shapes data takes on its way from a file to a training step.

A *message log* is one conversation: a list of messages, each with its role, its text and,
once tokenised, its token ids. Multi-turn rollouts append to it; earlier messages' token ids
are never recomputed.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

import torch


class Message(TypedDict):
    """One turn of a conversation."""

    role: str  # "system", "user", "assistant", "tool" or "environment"
    content: str
    token_ids: NotRequired[torch.Tensor]  # 1-D int64, this message's tokens only
    # Which of this message's tokens the loss is computed on (1) or not (0); same length.
    token_loss_mask: NotRequired[torch.Tensor]
    generation_logprobs: NotRequired[torch.Tensor]  # from the generator, for off-policy fixes
    # [tokens, layers, k] int16: the experts a mixture-of-experts generator routed each token
    # to (-1: none recorded), for the policy's router replay.
    routed_experts: NotRequired[torch.Tensor]
    # What chat templates read besides role and content (kept from the data, never dropped).
    tool_calls: NotRequired[list[dict[str, Any]]]
    tool_call_id: NotRequired[str]
    name: NotRequired[str]
    reasoning_content: NotRequired[str]


MessageLog = list[Message]
# The key of a row's ``extra_env_info`` that keeps its prompt as the dataset wrote it when that
# was a string (TRL's standard format: a ``prompt`` column of strings, or ``prompt_key``), so
# that reward functions get strings as TRL gives them; absent for a conversation. Not a column:
# the reward-functions environment takes it out before the functions see the row's columns.
STRING_PROMPT_KEY = "_string_prompt"
# The key of a row's ``extra_env_info`` that holds the tools its conversation is offered (a
# ``tools`` column of OpenAI function schemas, checked): the prompt is rendered with them, and
# an environment reads there which tools the sample may call. Reward functions get it as the
# ``tools`` column, as TRL gives it.
TOOLS_KEY = "tools"
# A message's per-token tensors: what is recomputed, cut or left out of what a template sees.
TENSOR_KEYS = frozenset({"token_ids", "token_loss_mask", "generation_logprobs", "routed_experts"})


class DatumSpec(TypedDict):
    """One training example for SFT or RL, after its processor has run."""

    message_log: MessageLog
    length: int  # total tokens over all messages
    extra_env_info: dict[str, Any] | None  # what the environment needs (e.g. the answer)
    loss_multiplier: float  # 0.0 keeps an over-long sample in place but out of the loss
    idx: int  # position in the dataset
    task_name: NotRequired[str]  # which environment scores it


class PreferenceDatumSpec(TypedDict):
    """One preference pair (DPO, reward-model training)."""

    message_log_chosen: MessageLog
    message_log_rejected: MessageLog
    length_chosen: int
    length_rejected: int
    loss_multiplier: float
    idx: int
    task_name: NotRequired[str]


class TaskDataSpec(TypedDict, total=False):
    """Per-task prompting: how raw rows of one task become messages."""

    task_name: str
    system_prompt: str | None
    prompt_template: str | None  # a format string with {} (or {prompt}) for the user's text
