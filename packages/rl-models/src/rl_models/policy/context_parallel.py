"""Context parallelism: each row's tokens split along the sequence over the ``cp`` ranks.

Long rows cost memory in every activation; with ``dtensor.context_parallel_size`` > 1 the
ranks of one ``cp`` group get the same micro-batch and each runs the model on its own share
of every row's tokens only. Everything but attention is per token and needs nothing more.
Attention is computed by the ``rl_context_parallel`` kernel (below): each rank's queries
attend to the keys of the WHOLE row, all-gathered over the group at every layer (the design
Llama 3's training used: no ring of partial softmaxes, and it keeps any mask, so packed rows
work). The gather's backward hands each rank its keys' and values' gradients summed over
the ranks whose queries read them (``ContextGroup.gather``: a reduce-scatter).

Sharding (``split_indices``): a row is padded to a multiple of ``2 * cp`` and cut into
``2 * cp`` equal chunks; rank ``i`` takes chunks ``i`` and ``2 * cp - 1 - i``. The mask is
dense, so every rank's attention costs the same ``L x S`` whatever it holds; the pairing of
an early chunk (whose queries see few keys) with a late one (many) evens out the *unmasked*
query-key pairs, the work a kernel that skips masked blocks would do (this sdpa call does
not). Position ids are the global ones (rotary embeddings see where a token really is), and
per-token inputs computed from the whole row, such as next-token targets, are shifted BEFORE
the split (``ContextSplit.local``): a chunk's last token keeps its target even when the next
token lives on another rank.

The mask of a rank's queries against the gathered keys is built from each token's index in
the row (causality) and its document: a padded micro-batch's rows are one document each, a
packed row's sequences one document each, padding a document of its own (-1) that no real
token sees. A padding query sees earlier padding and itself, never an empty row. Each
split builds the mask once as an additive float tensor in the attention's dtype
(``ContextSplit.attention_bias``) that every layer passes to sdpa: handed a bool mask, sdpa
would make (and save for backward) a float copy at every layer.

Per-token outputs (log-probs) come back whole on every rank of the group
(``ContextSplit.gathered``), in the row's order, so losses need not know about context
parallelism. Every rank then computes the same loss from the same values; the gather's
backward hands each rank the gradient of its own tokens' outputs only, once (summing the
ranks' identical gradients, as a plain all-gather's backward does, would count them ``cp``
times). Each rank's parameter gradients then cover its own tokens; FSDP2's reduction over
the ranks adds them up (the worker undoes its average, see ``dtensor_worker``). Keys, values
and outputs go through one gather (``ContextGroup.gather``), which calls the group's own
collectives: it works on any subgroup of the world (one ``cp`` group of several ``dp`` ranks).

The kernel is switched in by name for one forward call (``segment_attention.kernel_switched``):
activation checkpointing, whose recompute runs outside that call, is refused with it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from rl_models.policy.segment_attention import attention_dtype, kernel_switched

NAME = "rl_context_parallel"


def split_indices(width: int, size: int, rank: int) -> torch.Tensor:
    """The row positions (of the row padded to a multiple of ``2 * size``) that context-
    parallel rank ``rank`` of ``size`` holds: chunks ``rank`` and ``2 * size - 1 - rank`` of
    ``2 * size`` (module docstring)."""
    chunk = -(-width // (2 * size))
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat([first, second])


def gathered_order(width: int, size: int) -> torch.Tensor:
    """The row positions of the group's tokens in the order an all-gather concatenates them."""
    return torch.cat([split_indices(width, size, r) for r in range(size)])


@dataclass(frozen=True)
class ContextGroup:
    """This rank's context-parallel group: its ranks share micro-batches and split their rows."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> ContextGroup:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def gather(self, t: torch.Tensor, dim: int, *, same_gradient: bool = False) -> torch.Tensor:
        """The group's ranks' ``t`` concatenated along ``dim``, in group-rank order. Backward
        hands each rank the gradient of its own slice, summed over the group's ranks (each
        rank's queries read every rank's keys), or with ``same_gradient`` (every rank
        computes the same loss from the gathered whole, so their gradients are equal) as it
        is: summing would count it ``size`` times."""
        return _Gather.apply(t, self, dim, same_gradient)

    def split(self, inputs: dict[str, Any], documents: torch.Tensor) -> ContextSplit:
        """``inputs`` (the model's keyword arguments over whole ``[B, S]`` rows) split for this
        rank; ``documents`` ``[B, S]``: each token's document (-1: padding)."""
        ids = inputs["input_ids"]
        rows, width = ids.shape
        device = ids.device
        positions = inputs.get("position_ids")
        if positions is None:  # padded rows: positions count from each row's start
            positions = torch.arange(width, device=device).expand(rows, width)
        index = split_indices(width, self.size, self.rank).to(device)
        order = gathered_order(width, self.size).to(device)
        padded = int(order.numel())
        docs = F.pad(documents.to(device), (0, padded - width), value=-1)
        # Query t sees key u of the same document at or before it in the row.
        same = docs[:, index, None] == docs[:, None, order]
        mask = (same & (order[None, None, :] <= index[None, :, None]))[:, None]
        split = ContextSplit(self, width, index, torch.argsort(order), mask, {})
        local = {**inputs, "input_ids": split.local(ids), "position_ids": split.local(positions)}
        # No mask for Hugging Face to build or read: the kernel's is ``mask``.
        return dataclasses.replace(split, inputs={**local, "attention_mask": None})


@dataclass(frozen=True)
class ContextSplit:
    """One micro-batch's rows as this rank holds them (``ContextGroup.split``)."""

    cp: ContextGroup
    width: int  # S, the rows' width before padding
    index: torch.Tensor  # [L] this rank's row positions
    restore: torch.Tensor  # [cp * L] gathered order -> row order
    mask: torch.Tensor  # [B, 1, L, cp * L] bool: local queries against the gathered keys
    inputs: dict[str, Any]  # the model's keyword arguments for this rank's tokens
    # ``mask`` as sdpa's additive bias, by dtype: built at the first layer, shared by the rest.
    _biases: dict[torch.dtype, torch.Tensor] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a per-token ``[B, S, ...]`` tensor (padded with 0)."""
        padded = self.restore.numel()
        t = F.pad(t, (*(0, 0) * (t.dim() - 2), 0, padded - self.width))
        return t.index_select(1, self.index.to(t.device))

    def gathered(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, L, ...]`` per-token outputs of this rank's tokens -> ``[B, S, ...]`` of the
        whole rows, the same on every rank; backward gives each rank its tokens' gradient."""
        whole = self.cp.gather(t, 1, same_gradient=True)
        return whole.index_select(1, self.restore.to(t.device))[:, : self.width]

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as the float bias sdpa adds to the scores (0 where a query sees a key,
        -inf elsewhere), in ``dtype``: one tensor for all layers, so autograd saves one."""
        bias = self._biases.get(dtype)
        if bias is None:
            rows, _, queries, keys = self.mask.shape
            # Allocated with the key dimension padded to a multiple of 16 and viewed back:
            # sdpa's memory-efficient CUDA path pads (copies, at every call) a bias whose
            # strides are not multiples of 8.
            aligned = -(-keys // 16) * 16
            whole = torch.zeros(rows, 1, queries, aligned, dtype=dtype, device=self.mask.device)
            bias = whole[..., :keys].masked_fill_(~self.mask, float("-inf"))
            self._biases[dtype] = bias
        return bias

    @contextlib.contextmanager
    def attending(self, model: torch.nn.Module) -> Iterator[None]:
        """While inside, ``model``'s attention layers attend over the group's whole rows."""
        token = _ACTIVE.set(self)
        try:
            with kernel_switched(model, NAME):
                yield
        finally:
            _ACTIVE.reset(token)


class NoSplit:
    """What ``ContextSplit`` offers, for a rank that holds its rows whole."""

    def __init__(self, inputs: dict[str, Any]) -> None:
        self.inputs = inputs

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gathered(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def attending(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _Gather(torch.autograd.Function):
    """``ContextGroup.gather``. Only the group's own collectives (``dist.all_gather`` and
    ``dist.reduce_scatter`` take group ranks as they come): torch's autograd all-gather
    (``torch.distributed.nn``) scatters from group rank ``i`` as if it were global rank ``i``
    on gloo, which fails on any group not starting at global rank 0."""

    @staticmethod
    def forward(
        ctx, t: torch.Tensor, cp: ContextGroup, dim: int, same_gradient: bool
    ) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(cp.size)]
        dist.all_gather(parts, t.contiguous(), group=cp.group)
        ctx.cp, ctx.dim, ctx.same_gradient = cp, dim, same_gradient
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cp, dim = ctx.cp, ctx.dim
        slices = [part.contiguous() for part in grad.chunk(cp.size, dim)]
        if ctx.same_gradient:
            return slices[cp.rank], None, None, None
        own = torch.empty_like(slices[cp.rank])
        dist.reduce_scatter(own, slices, group=cp.group)
        return own, None, None, None


_ACTIVE: contextvars.ContextVar[ContextSplit | None] = contextvars.ContextVar(
    "rl_context_split", default=None
)


def context_parallel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function signature: this rank's ``query [B, H, L, D]``, its
    ``key`` and ``value [B, H_kv, L, D]``; returns ``[B, L, H, D]``. The keys and values of
    the whole rows are all-gathered over the group (as many heads as the model has: grouped-
    query attention repeats them after the gather). ``attention_mask`` is not read (the
    split's mask says who sees whom)."""
    unsupported = [k for k in ("softcap", "sliding_window", "s_aux") if kwargs.get(k) is not None]
    if unsupported:
        raise ValueError(f"attention kernel {NAME!r} does not apply {unsupported}")
    split = _ACTIVE.get()
    if split is None:
        raise RuntimeError(f"attention kernel {NAME!r} called outside ContextSplit.attending")
    # Keys and values side by side: one collective per layer, not two.
    both = split.cp.gather(torch.cat([key, value], -1), 2)
    keys, values = both.split([key.shape[-1], value.shape[-1]], -1)
    dtype = attention_dtype(query)
    groups = query.shape[1] // key.shape[1]
    with torch.autocast(query.device.type, enabled=False):
        out = F.scaled_dot_product_attention(
            query.to(dtype),
            repeat_kv(keys, groups).to(dtype),
            repeat_kv(values, groups).to(dtype),
            attn_mask=split.attention_bias(dtype),
            dropout_p=dropout,
            scale=scaling,
        )
    return out.transpose(1, 2).contiguous().to(query.dtype), None


AttentionInterface.register(NAME, context_parallel_attention)
