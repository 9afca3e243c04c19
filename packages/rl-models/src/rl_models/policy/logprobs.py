"""Next-token log-probs without a ``[tokens, vocab]`` logits tensor in memory.

A model's output layer turns ``[T, H]`` hidden states into ``[T, V]`` logits; at a 151k
vocabulary and 16k tokens that is ~10 GB in float32 before the log-softmax and its backward
double it. Here the output layer is applied ``chunk_size`` tokens at a time: each chunk's
logits live only while that chunk's log-probs are computed, and backward recomputes them
(activation checkpointing per chunk), so peak memory holds one chunk of logits, not all.
The gradients are those of the unchunked computation (same operations, recomputed): exactly
in float32 and float64; under bf16 the weight's and bias's gradients are sums of per-chunk
products, each rounded to the parameter's dtype and added in it (bf16 parameters: one
rounding per chunk more than unchunked; float32 master weights: none).
Targets may carry a trailing dimension (``[..., k]``: the log-probs of k given tokens per
position, a distillation student's at its teacher's top-k ids), and ``chunked_topk_logprobs``
gives a position's k most likely tokens and their log-probs (a distillation teacher's side).
With ``entropy`` each position also gets the entropy of its whole distribution, ``H = -sum_v
p_v log p_v``, from the same chunk of logits (an entropy bonus in a policy-gradient loss).

``output_layer_computes_logprobs`` makes a Hugging Face model do this inside its own forward:
its output layer's forward is swapped for the chunked log-prob computation while the model
runs, so whatever wraps the model (FSDP2's hooks, peft) sees an ordinary call and an ordinary
output (``logits`` then holds the ``[B, S]`` log-probs of ``targets``).

Under tensor parallelism each rank holds a slice of the vocabulary (the output layer's rows):
``vocab_parallel_logprobs`` computes the log-softmax over the whole vocabulary from the
slices, all-reducing one max, one sum and the target logit per position over the group, so no
rank ever holds a position's whole row of logits. The Megatron worker and the DTensor
worker's tensor-parallel output layer (``policy/tensor_parallel.py``) both use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HALF = (torch.float16, torch.bfloat16)


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    return scaled_logits(F.linear(hidden, weight, bias), temperature)


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in at least float32: half precisions are upcast for a stable
    (log-)softmax."""
    if logits.dtype in HALF:
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def weighted_logit_sum(weights: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``sum_v weights_v z_v`` over the last dimension (kept, size 1): the term of the entropy
    ``H = logsumexp(z) - sum_v p_v z_v`` (``weights`` the probabilities, or a vocabulary shard's
    unnormalised ``e^(z_v - max z)``).

    A masked-out token (``z_v = -inf``, so its weight is ``e^-inf = 0``) adds 0, where the
    plain product gives ``0 * -inf = NaN``; ``z`` is zeroed there before the product, not the
    product after it, so autograd's gradients are finite too (the product's backward would
    multiply by ``-inf`` again). Without a graph to keep (no gradient, or none wanted) the
    products overwrite ``weights``, which every caller passes as a temporary: a chunk then
    holds no third ``[n, V]`` float32 buffer beside its logits and softmax."""
    masked = torch.isneginf(z)
    if torch.is_grad_enabled() and (weights.requires_grad or z.requires_grad):
        return (weights * z.masked_fill(masked, 0.0)).sum(-1, keepdim=True)
    return weights.mul_(z).masked_fill_(masked, 0.0).sum(-1, keepdim=True)


def logsumexp_and_entropy(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logsumexp(z)`` and the entropy ``H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v
    z_v`` of ``p = softmax(z)`` over the last dimension (both kept, size 1), for logits ``z``
    in the precision to compute in; a masked-out token (``z_v = -inf``) adds nothing."""
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    return lse, lse - weighted_logit_sum(torch.softmax(z, dim=-1), z)


def _chunk_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    cast: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    entropy: bool = False,
) -> torch.Tensor:
    """``hidden [n, H]``, ``targets [n]`` or ``[n, k]`` -> log-probs of ``targets``' shape
    (with ``entropy``: ``[n, 2]`` or ``[n, k + 1]``, the entropy last); ``cast`` is
    ``weight`` in the matmuls' dtype (``_matmul_dtype``), without gradient."""
    index = targets.unsqueeze(-1) if targets.dim() == 1 else targets  # [n, 1] or [n, k]
    picked = _TargetLogProbs.apply(hidden, weight, cast, bias, index, temperature, entropy)
    return picked if entropy else picked.view(targets.shape)


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run ``hidden @ weight.T`` in: its own when it is on (float64
    is never autocast), the inputs' promoted dtype otherwise."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (hidden.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _TargetLogProbs(torch.autograd.Function):
    """``log softmax((hidden @ weight.T + bias) / T)`` at ``index [n, k]``, with a backward
    written out: autograd's own takes the log-softmax apart into a dozen ``[n, V]`` passes
    (the upcast, logsumexp's, gather's zeros and scatter, their sum, the downcast), where
    the gradient of the logits is one expression, ``(onehot - softmax) * g / T``, made in
    place in one float32 buffer (then rounded to the matmuls' dtype). The matmuls run in the
    dtype autocast would give them (the inputs' otherwise); the log-softmax in at least
    float32. Saved for backward: the logits in their compute dtype (not a float32 copy).
    ``weight`` is the parameter (its gradient is returned in its dtype); ``cast`` the same
    values in the matmuls' dtype, made once for all chunks by ``chunked_logprobs``.

    With ``entropy`` a last column holds ``H = lse - sum_v p_v z_v``, the entropy of the whole
    distribution (``z`` the scaled logits), and the backward adds its gradient ``dH / dz_v =
    -p_v (log p_v + H)``: written out for the same reason, and since H's autograd graph would
    keep a float32 ``[n, V]`` softmax alive per chunk where this keeps only ``H [n, 1]``."""

    @staticmethod
    def forward(ctx, hidden, weight, cast, bias, index, temperature, entropy=False):
        device, dtype = hidden.device.type, cast.dtype
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(dtype), cast
            logits = F.linear(h, w, None if bias is None else bias.to(dtype))
            z = logits.float() if dtype in HALF else logits
            if temperature != 1.0:
                z = z / temperature
            ent = None
            if entropy:
                lse, ent = logsumexp_and_entropy(z)
                picked = torch.cat([z.gather(-1, index) - lse, ent], dim=-1)
            else:
                lse = torch.logsumexp(z, dim=-1, keepdim=True)
                picked = z.gather(-1, index) - lse
        ctx.save_for_backward(h, w, logits, index, lse, ent)
        ctx.temperature = temperature
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return picked

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        h, w, logits, index, lse, ent = ctx.saved_tensors
        temperature = ctx.temperature
        with torch.autocast(h.device.type, enabled=False):
            g = logits.to(lse.dtype, copy=True)
            if temperature != 1.0:
                g.div_(temperature)
            g.sub_(lse)  # log p
            if ent is None:
                # d picked[j] / d z = onehot(index[j]) - softmax(z); summed over the k columns.
                g.exp_().mul_(-grad.sum(-1, keepdim=True))
            else:
                # The entropy column adds g_H * dH/dz = -p (g_H (log p + H)), the log-prob
                # columns -p sum_j g_j: together -p * (g_H (log p + H) + sum_j g_j).
                grad, grad_ent = grad[:, :-1], grad[:, -1:].to(g.dtype)
                scale = (g + ent).mul_(grad_ent).add_(grad.sum(-1, keepdim=True).to(g.dtype))
                # A masked-out token (log p = -inf) has p = 0: its term is 0, not 0 * inf.
                scale.masked_fill_(torch.isneginf(g), 0.0)
                g.exp_().mul_(scale).neg_()
                del scale
            g.scatter_add_(-1, index, grad.to(g.dtype))
            if temperature != 1.0:
                g.div_(temperature)
            g = g.to(logits.dtype)
            need = ctx.needs_input_grad
            hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
            d_hidden = (g @ w).to(hidden_dtype) if need[0] else None
            d_weight = (g.T @ h).to(weight_dtype) if need[1] else None
            d_bias = g.sum(0).to(bias_dtype) if need[3] else None
        return d_hidden, d_weight, None, d_bias, None, None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group`` forward; the gradient passes through unchanged.

    Every rank of the group computes the same loss from the summed value, so the gradient of
    the loss by its own addend is the gradient by the sum, as it is (summing it again over
    the ranks would count it once per rank). Megatron's ``reduce_from_tensor_model_parallel
    _region`` is the same operation, bound to Megatron's group."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        t = t.clone(memory_format=torch.contiguous_format)  # all_reduce needs a dense tensor
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _sum_over(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return t
    return _SumOverGroup.apply(t, group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    entropy: bool = False,
) -> torch.Tensor:
    """``log p(targets)`` under ``softmax(logits / temperature)``, from this rank's columns
    ``[vocab_start, vocab_start + logits.shape[-1])`` of the logits; the other columns are on
    the other ranks of ``group``. ``targets`` is ``logits``' shape without its last dimension
    (one token per position) or with k in its place; with ``entropy`` (one token only) the
    result is ``[..., 2]``, the log-probs and the entropy of each position's distribution.

    A log-softmax over the whole vocabulary: the max and the sum of exponentials are
    all-reduced over ``group``, and each target's logit comes from the rank holding it.
    Columns at or past ``vocab_size`` (a vocabulary padded to a multiple of the group size)
    are not tokens and count as ``-inf``. The computation is in at least float32 and in
    float64 for float64 logits (exact comparisons); its gradient is autograd's.

    The entropy is ``log S - sum_v e^(s_v) s_v / S`` with ``s = z - max z`` and ``S = sum_v
    e^(s_v)``: each rank sums ``e^s s`` over its columns and the sums are all-reduced like ``S``.
    """
    shifted, sum_exp = _shifted_logits(logits, vocab_start, vocab_size, group, temperature)
    part = shifted.shape[-1]
    one = targets.dim() < logits.dim()
    local = (targets.unsqueeze(-1) if one else targets) - vocab_start
    here = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1))
    picked = _sum_over(torch.where(here, picked, 0.0), group)
    logprobs = picked - sum_exp.log()
    if not entropy:
        return logprobs.squeeze(-1) if one else logprobs
    if not one:
        raise ValueError("vocab_parallel_logprobs gives the entropy with one token per position")
    # Padding columns (s = -inf, e^s = 0) add 0, not 0 * -inf = NaN.
    weighted = _sum_over(weighted_logit_sum(shifted.exp(), shifted), group)
    return torch.cat([logprobs, sum_exp.log() - weighted / sum_exp], dim=-1)


def _shifted_logits(
    logits: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, S)``: this rank's columns of the scaled logits less the whole vocabulary's max,
    ``s = z - max z`` (padding columns ``-inf``), and ``S = sum_v e^(s_v)`` over the whole
    vocabulary (``[..., 1]``); ``log S`` is the log-softmax's normaliser of ``s``."""
    logits = scaled_logits(logits, temperature)
    part = logits.shape[-1]
    if vocab_start + part > vocab_size:  # the vocabulary's padding columns are not tokens
        column = torch.arange(vocab_start, vocab_start + part, device=logits.device)
        logits = logits.masked_fill(column >= vocab_size, float("-inf"))
    peak = logits.detach().amax(dim=-1, keepdim=True).contiguous()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak
    return shifted, _sum_over(shifted.exp().sum(dim=-1, keepdim=True), group)


@torch.no_grad()
def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probs of each position (descending) and their token ids, from
    this rank's columns of the logits (see ``vocab_parallel_logprobs``): each rank's own
    top-k, all-gathered over ``group`` (``k * tp`` candidates a position), then the top-k of
    those."""
    shifted, sum_exp = _shifted_logits(logits, vocab_start, vocab_size, group, temperature)
    own = min(k, shifted.shape[-1])
    top, ids = shifted.topk(own, dim=-1)
    if own < k:  # a rank with fewer columns than k: pad with candidates that never win
        top = F.pad(top, (0, k - own), value=float("-inf"))
        ids = F.pad(ids, (0, k - own))
    ids = ids + vocab_start
    if group is not None and dist.get_world_size(group) > 1:
        size = dist.get_world_size(group)
        tops = [torch.empty_like(top) for _ in range(size)]
        all_ids = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(tops, top.contiguous(), group=group)
        dist.all_gather(all_ids, ids.contiguous(), group=group)
        top, pick = torch.cat(tops, -1).topk(k, dim=-1)
        ids = torch.cat(all_ids, -1).gather(-1, pick)
    return top - sum_exp.log(), ids


def _vocab_parallel_chunk(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    temperature: float,
    entropy: bool,
) -> torch.Tensor:
    """One chunk: this rank's columns of the logits, then the distributed log-softmax."""
    logits = F.linear(hidden, weight, bias)
    return vocab_parallel_logprobs(
        logits, targets, vocab_start, vocab_size, group, temperature, entropy
    )


def chunked_vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
) -> torch.Tensor:
    """``chunked_logprobs`` for an output layer split by rows over ``group``: ``weight
    [V/tp, H]`` (and ``bias``) are this rank's rows, from ``vocab_start``; ``hidden [..., H]``
    is the whole input, as every rank of the group has it. At most ``[chunk_size, V/tp]``
    logits exist at once (recomputed in backward); see ``vocab_parallel_logprobs``."""
    return over_token_chunks(
        _vocab_parallel_chunk,
        hidden,
        targets,
        chunk_size,
        weight,
        bias,
        vocab_start,
        vocab_size,
        group,
        temperature,
        entropy,
    )


def over_token_chunks(
    fn: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None,
    *args: Any,
) -> torch.Tensor:
    """``fn(hidden [n, H], targets [n, *rest], *args) -> [n, *out]`` over ``hidden [..., H]``,
    ``targets [..., *rest]`` (the same leading dimensions as ``hidden``), ``chunk_size`` tokens
    at a time (``None``: all at once); the result is ``[..., *out]`` (``hidden``'s leading
    dimensions). With gradients each chunk is recomputed in backward (checkpointed), so
    whatever ``fn`` makes (the chunk's logits) lives only while that chunk is computed.
    ``fn`` may run collectives (the Megatron worker's vocab-parallel log-softmax): every rank
    of the group must then use the same chunks, which it does when their token counts agree.
    """
    lead = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    tokens = flat_hidden.shape[0]
    flat_targets = targets.reshape(tokens, *targets.shape[hidden.dim() - 1 :])
    if chunk_size is None or chunk_size >= tokens:
        out = fn(flat_hidden, flat_targets, *args)
        return out.view(*lead, *out.shape[1:])
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
    return torch.cat(out).view(*lead, *out[0].shape[1:])


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
) -> torch.Tensor:
    """``log softmax((hidden @ weight.T + bias) / temperature)[targets]`` for ``hidden
    [..., H]``, ``targets [...]`` (one token per position) or ``[..., k]`` (k tokens per
    position), computed ``chunk_size`` tokens at a time (``None``: all at once).

    With ``entropy`` the result has one more column, ``[..., 2]`` (``[..., k + 1]``): the
    log-prob(s), then the entropy ``-sum_v p_v log p_v`` of that position's whole
    distribution, differentiable like the log-probs."""
    # The weight in the matmuls' dtype once for all chunks (under autocast a [V, H] copy,
    # held until backward, as autocast's own cache would hold it), outside autograd: each
    # chunk's weight gradient still comes back in the weight's own dtype, so the chunks'
    # gradients add up in that dtype (float32 master weights: float32, not bf16).
    cast = weight.detach().to(_matmul_dtype(hidden, weight))
    return over_token_chunks(
        _chunk_logprobs, hidden, targets, chunk_size, weight, cast, bias, temperature, entropy
    )


@torch.no_grad()
def chunked_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    chunk_size: int | None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_parallel: tuple[int, int, dist.ProcessGroup] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of ``log softmax((hidden @ weight.T + bias) / temperature)``
    per position of ``hidden [..., H]``: values ``[..., k]`` (descending) and their token ids
    ``[..., k]`` (int64), ``chunk_size`` tokens at a time. No gradient: this is what a frozen
    teacher reports, and ``[chunk_size, V]`` logits are the most that exist at once.

    ``vocab_parallel``: ``(first row, vocabulary size, group)`` when ``weight`` and ``bias``
    are this rank's rows of an output layer split over ``group`` (``vocab_parallel_topk``)."""
    vocab = weight.shape[0] if vocab_parallel is None else vocab_parallel[1]
    if not 0 < k <= vocab:
        raise ValueError(f"top-k needs 0 < k <= vocabulary size {vocab}, got k={k}")
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    step = flat.shape[0] if chunk_size is None else chunk_size
    values, ids = [], []
    for start in range(0, flat.shape[0], max(step, 1)):
        if vocab_parallel is not None:
            logits = F.linear(flat[start : start + step], weight, bias)
            top, top_ids = vocab_parallel_topk(logits, k, *vocab_parallel, temperature)
            values.append(top)
            ids.append(top_ids)
            continue
        logits = _chunk_logits(flat[start : start + step], weight, bias, temperature)
        # log-softmax is the logits minus one number per row: same order, so top-k the logits.
        top, top_ids = logits.topk(k, dim=-1)
        values.append(top - torch.logsumexp(logits, dim=-1, keepdim=True))
        ids.append(top_ids)
    if not values:  # no tokens
        dtype = _chunk_logits(flat[:0], weight, bias, temperature).dtype
        return hidden.new_zeros((*lead, k), dtype=dtype), torch.zeros(
            (*lead, k), dtype=torch.long, device=hidden.device
        )
    return torch.cat(values).view(*lead, k), torch.cat(ids).view(*lead, k)


@contextlib.contextmanager
def output_layer_computes_logprobs(
    model: torch.nn.Module,
    targets: torch.Tensor,
    chunk_size: int | None,
    temperature: float = 1.0,
    keep: torch.Tensor | None = None,
    entropy: bool = False,
) -> Iterator[None]:
    """While inside, ``model``'s output layer returns log-probs of ``targets`` (``[B, S]``, or
    ``[B, S, k]`` for k tokens per position) instead of logits: ``model(...).logits`` is then
    ``log p(targets)`` at every position, or, given a ``[B, S]`` bool ``keep``, at the kept
    positions only (0 elsewhere): the output layer then never sees the other positions' hidden
    states. With ``entropy`` each position's entropy follows as one more column
    (``chunked_logprobs``)."""
    head = _linear_head(model)

    def logprobs_forward(hidden: torch.Tensor) -> torch.Tensor:
        if _is_vocab_parallel(head):
            hidden, weight, bias, start, vocab, group = _vocab_parallel_pieces(head, hidden)

            def logprobs_of(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                return chunked_vocab_parallel_logprobs(
                    h, weight, t, chunk_size, start, vocab, group, bias, temperature, entropy
                )
        else:

            def logprobs_of(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                return chunked_logprobs(
                    h, head.weight, t, chunk_size, head.bias, temperature, entropy
                )

        if keep is None:
            return logprobs_of(hidden, targets)
        kept = logprobs_of(hidden[keep], targets[keep])
        shape = (*keep.shape, *kept.shape[1:])
        mask = keep.view(*keep.shape, *[1] * (len(shape) - keep.dim())).expand(shape)
        return kept.new_zeros(shape).masked_scatter(mask, kept)

    head.forward = logprobs_forward
    try:
        yield
    finally:
        del head.forward  # back to the class's forward


@contextlib.contextmanager
def output_layer_computes_topk(
    model: torch.nn.Module, k: int, chunk_size: int | None, temperature: float = 1.0
) -> Iterator[dict[str, torch.Tensor]]:
    """While inside, ``model``'s output layer returns the top-``k`` log-probs of every position
    (``[B, S, k]``, see ``chunked_topk_logprobs``) instead of logits; their token ids are left
    in the yielded dict under ``"ids"`` (the model's output can carry one tensor only)."""
    head = _linear_head(model)
    found: dict[str, torch.Tensor] = {}

    def topk_forward(hidden: torch.Tensor) -> torch.Tensor:
        if _is_vocab_parallel(head):
            hidden, weight, bias, first, vocab, group = _vocab_parallel_pieces(head, hidden)
            values, found["ids"] = chunked_topk_logprobs(
                hidden, weight, k, chunk_size, bias, temperature, (first, vocab, group)
            )
            return values
        values, found["ids"] = chunked_topk_logprobs(
            hidden, head.weight, k, chunk_size, head.bias, temperature
        )
        return values

    head.forward = topk_forward
    try:
        yield found
    finally:
        del head.forward


def _is_vocab_parallel(head: torch.nn.Linear) -> bool:
    """Whether ``head``'s rows (the vocabulary) are split over a tensor-parallel mesh: then,
    inside the model's forward, its weight is a DTensor (FSDP2 alone leaves a plain tensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(head.weight, DTensor)


def _vocab_parallel_pieces(head: torch.nn.Linear, hidden: torch.Tensor) -> tuple[Any, ...]:
    """``(hidden, weight rows, bias rows, first row, vocabulary size, group)`` of an output
    layer split by rows (``Shard(0)``, ``torch.chunk``'s split) over a one-dimensional
    tensor-parallel mesh, as local tensors.

    The layer's input hook has made ``hidden`` whole on every rank (``Replicate``); each
    rank's gradient of it covers its own rows of the vocabulary only, so it is a partial sum,
    which the hook's backward adds up over the ranks."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    weight = head.weight
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"vocab-parallel log-probs need the output layer's rows split over one mesh "
            f"dimension (Shard(0)); it has {tuple(weight.placements)} over {mesh}"
        )
    if isinstance(hidden, DTensor):
        hidden = hidden.to_local(grad_placements=(Partial(),))
    vocab = weight.shape[0]
    start = min(mesh.get_local_rank() * -(-vocab // mesh.size()), vocab)
    bias = None if head.bias is None else head.bias.to_local()
    return hidden, weight.to_local(), bias, start, vocab, mesh.get_group()


def _linear_head(model: torch.nn.Module) -> torch.nn.Linear:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"chunked log-probs need a Linear output layer, not {type(head)}")
    return head


def supports_chunked_logprobs(model: torch.nn.Module) -> bool:
    """Whether the output layer's result is the logits as they are (no soft-capping etc.)."""
    config = getattr(model, "config", None)
    capped = getattr(config, "final_logit_softcapping", None) is not None
    scaled = getattr(config, "logit_scale", None) not in (None, 1.0)
    return not capped and not scaled and isinstance(model.get_output_embeddings(), torch.nn.Linear)
