"""Attention over the blocks of a shared-prefix packed row, not over the whole row.

A packed row of ``shared_prefix.py`` holds a prompt once and then the rest of each of its G
samples. Every token attends to the prompt and to its own sample's earlier tokens, never to
another sample's. A dense kernel under a block mask still computes every pair of the row,
``(P + G R)^2`` of them, most of them masked. Here each sample is its own small attention
problem: its ``R`` queries against its prompt's ``P`` keys followed by its own ``R`` keys,
``G R (P + R)`` pairs, and the prompt its own causal problem, ``P^2``. For the main recipe's
rows (P = 46, G = 8, R ~ 25) that is about a third of the pairs; the saving grows with G and R.

How: the keys and queries of each problem are gathered out of the packed row (the prompt's
keys once per sample that reads them; backward sums their gradients), problems of one shape
run as one batched ``scaled_dot_product_attention`` per kind under a causal-with-prefix mask
(below), and the
outputs are scattered back to their tokens. Problems are batched by kind (a prompt alone,
or a row's rest after its prompt), each kind padded to its largest problem. Every token of
the packed row is a query of exactly one problem; the row's padding is a query of none and gets zeros (its outputs are
never read).

The kernel is chosen by name through Hugging Face's ``AttentionInterface`` while
``attention_by_segments`` is active: the model's attention layers call it with their own
projected, rotated queries and keys, so the projections, norms and MLPs run as they always
do. The layout travels in a context variable, not through the model's call, and the switch
is on the model's config: a recompute in backward (activation checkpointing) would run
outside the context, so callers use this only without it (``shared_prefix.py``; a
checkpoint the detection there misses fails loudly, torch's recompute finding other saved
tensors). The config is the model's own object, switched for the length of one forward
call: another model sharing it would see the kernel meanwhile.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from rl_models.policy.logprobs import HALF

NAME = "rl_segments"


@dataclass(frozen=True)
class Problems:
    """Attention problems of one shape, ``n`` of them: flat token indices into the packed
    rows (``[rows * width]``) of each one's queries and keys, and its mask."""

    queries: torch.Tensor  # [n * q_len] (padding points at token 0)
    keys: torch.Tensor  # [n * k_len] (padding points at token 0)
    mask: torch.Tensor  # [n, 1, q_len, k_len] bool
    outputs: torch.Tensor  # which of the n * q_len query slots are real tokens
    destinations: torch.Tensor  # the flat token index of each real query slot

    @property
    def pairs(self) -> int:
        return int(self.mask.shape[0] * self.mask.shape[2] * self.mask.shape[3])


@dataclass(frozen=True)
class SegmentLayout:
    """The problems of a batch of packed rows: a list per shape (prompts, samples)."""

    problems: list[Problems]
    tokens: int  # rows * width of the packed batch


def segment_layout(
    blocks: list[list[tuple[list[int], list[int]]]], width: int, device: torch.device
) -> SegmentLayout:
    """``blocks[row]``: that packed row's problems, each (prefix positions, own positions):
    the own positions are its queries; its keys are the prefix's then its own. Problems with
    a prefix and problems without are batched apart (their shapes differ most)."""
    kinds: dict[bool, list[tuple[list[int], list[int]]]] = {True: [], False: []}
    for row, problems in enumerate(blocks):
        for prefix, own in problems:
            flat = [row * width + c for c in prefix], [row * width + c for c in own]
            kinds[bool(prefix)].append(flat)
    built = [_problems(found, device) for found in kinds.values() if found]
    return SegmentLayout(built, len(blocks) * width)


def _problems(found: list[tuple[list[int], list[int]]], device: torch.device) -> Problems:
    q_len = max(len(own) for _, own in found)
    k_len = max(len(prefix) + len(own) for prefix, own in found)
    queries, keys, real = [], [], []
    mask = torch.zeros(len(found), 1, q_len, k_len, dtype=torch.bool)
    for i, (prefix, own) in enumerate(found):
        p, r = len(prefix), len(own)
        queries += own + [0] * (q_len - r)
        keys += prefix + own + [0] * (k_len - p - r)
        real += [True] * r + [False] * (q_len - r)
        mask[i, 0, :r, :p] = True  # every query sees the whole prefix
        mask[i, 0, :r, p : p + r] = torch.ones(r, r, dtype=torch.bool).tril()
        mask[i, 0, r:, 0] = True  # padding queries see one key (no empty softmax); dropped
    queries_t = torch.tensor(queries, device=device)
    outputs = torch.tensor(real, device=device).nonzero().squeeze(1)
    return Problems(
        queries=queries_t,
        keys=torch.tensor(keys, device=device),
        mask=mask.to(device),
        outputs=outputs,
        destinations=queries_t[outputs],
    )


_ACTIVE: contextvars.ContextVar[SegmentLayout | None] = contextvars.ContextVar(
    "rl_segment_layout", default=None
)


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function signature: ``query [B, H, L, D]``, ``key`` and
    ``value [B, H_kv, L, D]`` over the packed rows; returns ``[B, L, H, D]`` (no weights).
    ``attention_mask`` is not read (the layout says who sees whom; callers pass None)."""
    unsupported = [k for k in ("softcap", "sliding_window", "s_aux") if kwargs.get(k) is not None]
    if unsupported:
        raise ValueError(f"attention kernel {NAME!r} does not apply {unsupported}")
    layout = _ACTIVE.get()
    if layout is None:
        raise RuntimeError(f"attention kernel {NAME!r} called outside attention_by_segments")
    rows, heads, width, dim = query.shape
    value_dim = value.shape[-1]
    if rows * width != layout.tokens:
        raise ValueError(f"the layout is for {layout.tokens} tokens, the call has {rows * width}")
    dtype = attention_dtype(query)
    # Keys and values repeated per query head: with a mask, sdpa's own grouped-query option
    # would send CUDA to its math kernel (Hugging Face's sdpa path repeats them too).
    q = query.transpose(1, 2).reshape(rows * width, heads, dim).to(dtype)
    groups = heads // key.shape[1]
    k = repeat_kv(key, groups).transpose(1, 2).reshape(rows * width, heads, -1).to(dtype)
    v = repeat_kv(value, groups).transpose(1, 2).reshape(rows * width, heads, -1).to(dtype)
    out = q.new_zeros(rows * width, heads, value_dim)
    for p in layout.problems:
        n, _, q_len, k_len = p.mask.shape
        with torch.autocast(query.device.type, enabled=False):
            o = F.scaled_dot_product_attention(
                _gathered(q, p.queries, n, q_len),
                _gathered(k, p.keys, n, k_len),
                _gathered(v, p.keys, n, k_len),
                attn_mask=p.mask,
                dropout_p=dropout,
                scale=scaling,
            )
        o = o.transpose(1, 2).reshape(n * q_len, heads, value_dim).index_select(0, p.outputs)
        out = out.index_copy(0, p.destinations, o)
    return out.view(rows, width, heads, value_dim).to(query.dtype), None


def attention_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype a kernel here runs ``scaled_dot_product_attention`` in for ``query``'s.

    On a CPU the flash kernel runs these small problems faster in float32 than in bf16 (and
    the softmax is then float32, as eager attention has it); on an accelerator the half
    kernel is the fast one."""
    return torch.float32 if query.dtype in HALF and query.device.type == "cpu" else query.dtype


def _gathered(t: torch.Tensor, index: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``[n, heads, length, D]`` from the flat tokens ``t [tokens, heads, D]`` at ``index``."""
    return t.index_select(0, index).view(n, length, *t.shape[1:]).transpose(1, 2)


AttentionInterface.register(NAME, segment_attention)


@contextlib.contextmanager
def attention_by_segments(model: torch.nn.Module, layout: SegmentLayout) -> Iterator[None]:
    """While inside, ``model``'s attention layers compute ``layout``'s problems (module
    docstring) instead of attending over whole rows."""
    token = _ACTIVE.set(layout)
    try:
        with kernel_switched(model, NAME):
            yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def kernel_switched(model: torch.nn.Module, name: str) -> Iterator[None]:
    """While inside, ``model``'s attention layers call the attention function registered as
    ``name`` (``AttentionInterface``) instead of the configured one."""
    config = model.config.get_text_config()
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
