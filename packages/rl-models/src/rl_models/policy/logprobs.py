"""Next-token log-probs without a ``[tokens, vocab]`` logits tensor in memory.

A model's output layer turns ``[T, H]`` hidden states into ``[T, V]`` logits; at a 151k
vocabulary and 16k tokens that is ~10 GB in float32 before the log-softmax and its backward
double it. Here the output layer is applied ``chunk_size`` tokens at a time: each chunk's
logits live only while that chunk's log-probs are computed, and backward recomputes them
(activation checkpointing per chunk), so peak memory holds one chunk of logits, not all.
The gradients are exactly those of the unchunked computation (same operations, recomputed).

``output_layer_computes_logprobs`` makes a Hugging Face model do this inside its own forward:
its output layer's forward is swapped for the chunked log-prob computation while the model
runs, so whatever wraps the model (FSDP2's hooks, peft) sees an ordinary call and an ordinary
output (``logits`` then holds the ``[B, S]`` log-probs of ``targets``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HALF = (torch.float16, torch.bfloat16)


def _chunk_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    if logits.dtype in HALF:  # a stable log-softmax: half precisions are upcast
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def over_token_chunks(
    fn: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None,
    *args: Any,
) -> torch.Tensor:
    """``fn(hidden [n, H], targets [n], *args) -> [n]`` over ``hidden [..., H]``, ``targets
    [...]``, ``chunk_size`` tokens at a time (``None``: all at once); the result has
    ``targets``' shape. With gradients each chunk is recomputed in backward (checkpointed), so
    whatever ``fn`` makes (the chunk's logits) lives only while that chunk is computed.
    ``fn`` may run collectives (the Megatron worker's vocab-parallel log-softmax): every rank
    of the group must then use the same chunks, which it does when their token counts agree.
    """
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    tokens = flat_targets.numel()
    if chunk_size is None or chunk_size >= tokens:
        return fn(flat_hidden, flat_targets, *args).view(shape)
    # Checkpointing only pays when backward will run; without grad the chunks already free
    # their logits as they go.
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (hidden, *args)
    )
    out = []
    for start in range(0, tokens, chunk_size):
        h = flat_hidden[start : start + chunk_size]
        t = flat_targets[start : start + chunk_size]
        if grad:
            out.append(checkpoint(fn, h, t, *args, use_reentrant=False))
        else:
            out.append(fn(h, t, *args))
    return torch.cat(out).view(shape)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log softmax((hidden @ weight.T + bias) / temperature)[targets]`` for ``hidden
    [..., H]``, ``targets [...]``, computed ``chunk_size`` tokens at a time (``None``: all at
    once)."""
    return over_token_chunks(
        _chunk_logprobs, hidden, targets, chunk_size, weight, bias, temperature
    )


@contextlib.contextmanager
def output_layer_computes_logprobs(
    model: torch.nn.Module,
    targets: torch.Tensor,
    chunk_size: int | None,
    temperature: float = 1.0,
    keep: torch.Tensor | None = None,
) -> Iterator[None]:
    """While inside, ``model``'s output layer returns log-probs of ``targets`` (``[B, S]``)
    instead of logits: ``model(...).logits`` is then ``log p(targets)`` at every position, or,
    given a ``[B, S]`` bool ``keep``, at the kept positions only (0 elsewhere): the output
    layer then never sees the other positions' hidden states."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"chunked log-probs need a Linear output layer, not {type(head)}")

    def logprobs_forward(hidden: torch.Tensor) -> torch.Tensor:
        if keep is None:
            return chunked_logprobs(
                hidden, head.weight, targets, chunk_size, head.bias, temperature
            )
        kept = chunked_logprobs(
            hidden[keep], head.weight, targets[keep], chunk_size, head.bias, temperature
        )
        return kept.new_zeros(targets.shape).masked_scatter(keep, kept)

    head.forward = logprobs_forward
    try:
        yield
    finally:
        del head.forward  # back to the class's forward


def supports_chunked_logprobs(model: torch.nn.Module) -> bool:
    """Whether the output layer's result is the logits as they are (no soft-capping etc.)."""
    config = getattr(model, "config", None)
    capped = getattr(config, "final_logit_softcapping", None) is not None
    scaled = getattr(config, "logit_scale", None) not in (None, 1.0)
    return not capped and not scaled and isinstance(model.get_output_embeddings(), torch.nn.Linear)
