"""Forward passes of a Hugging Face model over one micro-batch, padded or packed.

Three outputs, all in the row order and right padding of the micro-batch:

- ``forward_logprobs``: ``[B, S]`` next-token log-probs, 0 at position 0 and on padding;
- ``forward_logits``: ``[B, S, V]`` next-token logits aligned the same way (``[:, t]`` is the
  distribution that predicts token ``t``), for losses over the whole vocabulary;
- ``forward_scores``: ``[B, num_labels]`` sequence-classifier (reward model) scores read at
  each sequence's last real token.

Packed micro-batches (``packed=True``) put all sequences in one row with positions restarting
at 0 per sequence. How the sequences are kept apart depends on the attention kernel: sdpa and
eager get a dense block-diagonal causal mask; the flash-attention and flex kernels get no mask
at all and find the sequence boundaries from the position ids (Hugging Face's packed-sequence
path: variable-length kernels, no ``[T, T]`` mask in memory).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
)

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.packing import PackedSequences, pack_sequences, unpack_sequences
from rl_models.policy.config import PolicyConfig

DENSE_MASK_KERNELS = ("sdpa", "eager")


def build_model(config: PolicyConfig) -> PreTrainedModel:
    """The model the config names: a causal LM or a sequence classifier, fresh or pretrained."""
    cfg = config.model
    torch.manual_seed(config.seed)  # fresh weights are identical on every rank
    auto = AutoModelForCausalLM
    extra: dict[str, Any] = {}
    if cfg.kind == "sequence_classification":
        auto = AutoModelForSequenceClassification
        extra = {"num_labels": cfg.num_labels}
    if cfg.path is not None:
        return auto.from_pretrained(
            cfg.path, dtype=cfg.torch_dtype, attn_implementation=cfg.attn_implementation, **extra
        )
    hf = dict(cfg.hf_config or {})
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf, **extra)
    hf_config._attn_implementation = cfg.attn_implementation
    return auto.from_config(hf_config, dtype=cfg.torch_dtype)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(targets) under ``softmax(logits / temperature)``; half precisions are upcast."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _padding_mask(mb: BatchedDataDict) -> torch.Tensor:
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    pos = torch.arange(ids.shape[1], device=ids.device)
    return pos[None, :] < lengths[:, None].to(ids.device)


def _packed_inputs(
    mb: BatchedDataDict, attn_implementation: str
) -> tuple[PackedSequences, dict[str, torch.Tensor | None]]:
    """One packed row and the model arguments that keep its sequences apart."""
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    p = pack_sequences(ids, lengths)
    mask = None
    if attn_implementation in DENSE_MASK_KERNELS:
        # A token sees earlier tokens of its own sequence only.
        seq = torch.repeat_interleave(
            torch.arange(ids.shape[0], device=ids.device),
            p.cu_seqlens.diff().long().to(ids.device),
        )
        causal = torch.ones(seq.numel(), seq.numel(), dtype=torch.bool, device=ids.device).tril()
        mask = (causal & (seq[:, None] == seq[None, :]))[None, None]
    # No KV cache: with one, Hugging Face skips its packed-sequence detection.
    inputs = {"input_ids": p.input_ids, "position_ids": p.position_ids, "attention_mask": mask}
    return p, {**inputs, "use_cache": False}


def forward_logprobs(
    model: torch.nn.Module,
    mb: BatchedDataDict,
    packed: bool,
    attn_implementation: str = "sdpa",
    temperature: float = 1.0,
) -> torch.Tensor:
    """``[B, S]`` next-token log-probs of one micro-batch (0 at position 0 and on padding),
    under the temperature-scaled distribution (``PolicyConfig.logprob_temperature``)."""
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    if not packed:
        real = _padding_mask(mb)
        logits = model(input_ids=ids, attention_mask=real.long(), use_cache=False).logits
        return F.pad(token_logprobs(logits[:, :-1], ids[:, 1:], temperature), (1, 0)) * real
    p, inputs = _packed_inputs(mb, attn_implementation)
    logits = model(**inputs).logits
    lp = F.pad(token_logprobs(logits[0, :-1], p.input_ids[0, 1:], temperature), (1, 0))
    lp = lp * (p.position_ids[0] > 0)  # a sequence's first token has no log-prob
    return unpack_sequences(lp[None], p.cu_seqlens, lengths, ids.shape[1])


def forward_logits(
    model: torch.nn.Module, mb: BatchedDataDict, packed: bool, attn_implementation: str = "sdpa"
) -> torch.Tensor:
    """``[B, S, V]`` next-token logits; ``[:, t]`` predicts token ``t`` (0 at t=0 and padding)."""
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    if not packed:
        real = _padding_mask(mb)
        logits = model(input_ids=ids, attention_mask=real.long(), use_cache=False).logits
        return F.pad(logits[:, :-1], (0, 0, 1, 0)) * real[..., None]
    p, inputs = _packed_inputs(mb, attn_implementation)
    logits = F.pad(model(**inputs).logits[0, :-1], (0, 0, 1, 0))
    logits = logits * (p.position_ids[0] > 0)[:, None]
    return unpack_sequences(logits[None], p.cu_seqlens, lengths, ids.shape[1])


def forward_scores(
    model: PreTrainedModel, mb: BatchedDataDict, packed: bool, attn_implementation: str = "sdpa"
) -> torch.Tensor:
    """``[B, num_labels]`` classifier scores at each sequence's last real token.

    The backbone and the ``score`` head are called directly, rather than the model as a whole,
    because HF finds the last token from ``pad_token_id``, which a real token may equal, and
    cannot take packed rows.
    """
    ids, lengths = mb["input_ids"], mb["input_lengths"].to(mb["input_ids"].device)
    backbone, head = model.base_model, model.score
    if not packed:
        real = _padding_mask(mb).long()
        hidden = backbone(input_ids=ids, attention_mask=real, use_cache=False).last_hidden_state
        last = hidden[torch.arange(ids.shape[0], device=ids.device), lengths - 1]
    else:
        p, inputs = _packed_inputs(mb, attn_implementation)
        hidden = backbone(**inputs).last_hidden_state[0]
        starts = p.cu_seqlens[:-1].long().to(ids.device)
        last = hidden[starts + lengths - 1]
    return head(last)
