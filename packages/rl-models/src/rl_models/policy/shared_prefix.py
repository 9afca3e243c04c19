"""Log-probs of rows that share a prompt, with the prompt run once.

A GRPO micro-batch holds several samples of one prompt: ``G`` rows whose first ``P`` tokens
are the same, and whose loss reads only the response tokens after them. A plain forward runs
the transformer over the prompt ``G`` times. Here each group of rows with the same prompt
becomes one packed row: the prompt once, then each row's remaining tokens, under a block mask
that lets every remaining token see its prompt and its own row's earlier tokens. Backward sums
the rows' contributions into the one prompt pass. Log-probs and gradients are those of the
plain forward up to float rounding.

What it saves and costs: the per-token work (projections, MLP) drops from ``G (P + R)`` to
``P + G R`` tokens. Attention runs by segments (``segment_attention.py``): the prompt on its
own, ``P^2`` pairs, and each row's rest against the prompt and itself, ``R (P + R)``, the
pairs of the plain forward less the prompt's repeats. Under activation checkpointing it falls
back to one dense masked square per packed row, ``(P + G R)^2`` pairs, which grows past the
plain forward's ``G (P + R)^2`` for long responses. ``sharing_pays`` weighs the costs for the
micro-batch at hand (for SmolLM2-135M, ``G = 8``, ``P = 46``, ``R = 23``, sharing is ~40 % of
the plain forward's FLOPs) and runs the plain forward where sharing would not pay.

Which tokens are shared: a row's *prefix* is everything before the output position of its
first wanted log-prob (log p(token t) is read at position t - 1), so every wanted log-prob is
read from the row's own remaining tokens. Rows whose prefixes are identical share one copy.

Where it applies: Hugging Face models under the sdpa kernel (which takes a boolean 4-D mask as
given) without sliding-window layers (a hand-made mask would bypass their windows).
"""

from __future__ import annotations

import contextlib

import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.modeling.attention_layout import mixed_attention_reason
from rl_models.policy.logprobs import output_layer_computes_logprobs
from rl_models.policy.segment_attention import SegmentLayout, attention_by_segments, segment_layout


def prefix_lengths(wanted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` tokens before the position that predicts each row's first wanted token (0 for
    a row with nothing wanted: it has nothing to share)."""
    any_wanted = wanted.any(dim=1)
    first = wanted.to(torch.uint8).argmax(dim=1)
    prefix = torch.where(any_wanted, (first - 1).clamp(min=0), 0)
    return torch.minimum(prefix, (lengths - 1).clamp(min=0))


def shared_prefixes(ids: torch.Tensor, prefix: torch.Tensor) -> tuple[list[int], list[int]]:
    """The first row of each distinct non-empty prefix, and for every row the index of its
    prefix there (-1 for an empty one)."""
    first_row: dict[tuple[int, ...], int] = {}
    firsts: list[int] = []
    group = []
    for i, p in enumerate(prefix.tolist()):
        if p == 0:
            group.append(-1)
            continue
        key = tuple(ids[i, :p].tolist())
        if key not in first_row:
            first_row[key] = len(firsts)
            firsts.append(i)
        group.append(first_row[key])
    return firsts, group


def supports_shared_prefix(model: torch.nn.Module, attn_implementation: str) -> bool:
    """sdpa (a boolean mask is used as given; eager would add it to the scores) and plain
    causal attention in every layer (``mixed_attention_reason``: a sliding window, for one,
    would see past its window through the block mask)."""
    return attn_implementation == "sdpa" and mixed_attention_reason(model.config) is None


def _packed_rows(
    prefix: torch.Tensor, lengths: torch.Tensor, firsts: list[int], group: list[int]
) -> list[list[tuple[int, int, int, int]]]:
    """Each packed row as (row, col, segment, parent) per token: a shared prefix (segment
    ``-1 - g``) then the rest of every row with that prefix (segment ``i``, parent ``-1 - g``);
    a row with an empty prefix is a packed row of its own. A parent of ``B + 1`` is none."""
    none = len(group) + 1
    packed: list[list[tuple[int, int, int, int]]] = [
        [(i, c, -1 - g, none) for c in range(int(prefix[i]))] for g, i in enumerate(firsts)
    ]
    for i, g in enumerate(group):
        parent = -1 - g if g >= 0 else none
        rest = [(i, c, i, parent) for c in range(int(prefix[i]), int(lengths[i]))]
        if g >= 0:
            packed[g] += rest
        else:
            packed.append(rest)
    return packed


def _segments(
    packed: list[list[tuple[int, int, int, int]]], width: int, device: torch.device
) -> SegmentLayout:
    """The attention problems of the packed rows (``segment_attention.py``): each shared
    prefix on its own, then each row's rest after its prefix (or alone, without one)."""
    blocks = []
    for tokens in packed:
        prefix = [k for k, (_, _, seg, _) in enumerate(tokens) if seg < 0]
        own: dict[int, list[int]] = {}
        for k, (_, _, seg, _) in enumerate(tokens):
            if seg >= 0:
                own.setdefault(seg, []).append(k)
        blocks.append([([], prefix)] * bool(prefix) + [(prefix, rest) for rest in own.values()])
    return segment_layout(blocks, width, device)


def _segment_pairs(packed: list[list[tuple[int, int, int, int]]]) -> int:
    """The query-key pairs ``segment_attention`` computes for ``_segments(packed)``: per kind
    of problem (a prefix alone or a row without one; a row's rest after its prefix), the
    count of problems times the largest query length times the largest key length."""
    alone: list[int] = []  # query lengths of problems with no prefix (keys: the same)
    after: list[tuple[int, int]] = []  # (prefix length, rest length)
    for tokens in packed:
        prefix = sum(seg < 0 for _, _, seg, _ in tokens)
        rest = len(tokens) - prefix
        if prefix:
            alone.append(prefix)
            sizes: dict[int, int] = {}
            for _, _, seg, _ in tokens:
                if seg >= 0:
                    sizes[seg] = sizes.get(seg, 0) + 1
            after += [(prefix, r) for r in sizes.values()]
        else:
            alone.append(rest)
    pairs = len(alone) * max(alone, default=0) ** 2
    if after:
        pairs += len(after) * max(r for _, r in after) * max(p + r for p, r in after)
    return pairs


def recomputes_in_backward(model: torch.nn.Module) -> bool:
    """Whether some layer recomputes its forward in backward (activation checkpointing): the
    recompute would run outside ``attention_by_segments``, so the dense mask is used."""
    return any(
        getattr(m, "gradient_checkpointing", False) or type(m).__name__ == "CheckpointWrapper"
        for m in model.modules()
    )


def sharing_pays(
    model: torch.nn.Module, wanted: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor
) -> bool:
    """Whether the packed rows cost clearly fewer FLOPs than the padded batch: per layer,
    ~24 h^2 per token (projections and MLP) plus ~4 h per attended pair. Attention by
    segments computes each problem's pairs (``_segments``); the dense mask (under activation
    checkpointing) and the padded batch compute every pair of their squares."""
    prefix = prefix_lengths(wanted, lengths)
    firsts, group = shared_prefixes(ids, prefix)
    if len(firsts) == sum(g >= 0 for g in group):
        return False  # nothing shared
    hidden = model.config.get_text_config().hidden_size
    packed = _packed_rows(prefix, lengths, firsts, group)
    rows = [len(r) for r in packed]
    pairs = len(rows) * max(rows) ** 2 if recomputes_in_backward(model) else _segment_pairs(packed)
    width, batch = int(lengths.max()), len(lengths)
    shared = 24 * hidden * sum(rows) + 4 * pairs
    plain = 24 * hidden * batch * width + 4 * batch * width**2
    return shared < 0.8 * plain


def shared_prefix_logprobs(
    model: torch.nn.Module,
    mb: BatchedDataDict,
    wanted: torch.Tensor,
    chunk_size: int | None,
    temperature: float,
    entropy: bool = False,
) -> torch.Tensor:
    """``[B, S]`` log-probs at the ``wanted`` positions (0 elsewhere) of a right-padded
    micro-batch, each distinct prefix run once (module docstring); with ``entropy``,
    ``[B, S, 2]``: the log-probs, then the entropy of the distribution that predicts each
    token. ``model`` is a Hugging Face causal LM for which ``supports_shared_prefix`` holds and
    whose output layer returns plain logits (``supports_chunked_logprobs``). One ordinary
    forward call, so FSDP2's hooks see nothing unusual; under activation checkpointing the
    attention is the dense masked one (``recomputes_in_backward``)."""
    ids, lengths = mb["input_ids"], mb["input_lengths"].to(mb["input_ids"].device)
    device, (batch, width) = ids.device, ids.shape
    prefix = prefix_lengths(wanted, lengths)
    firsts, group = shared_prefixes(ids, prefix)
    packed = _packed_rows(prefix, lengths, firsts, group)
    longest = max(len(r) for r in packed)
    # Padding tokens: row 0, col 0, a segment of their own (each sees itself: no empty row in
    # the attention softmax), never kept.
    pad = (0, 0, batch, batch + 1)
    table = torch.tensor([r + [pad] * (longest - len(r)) for r in packed], device=device)
    rows, cols, seg, parent = table.unbind(-1)
    real = torch.tensor([[k < len(r) for k in range(longest)] for r in packed], device=device)
    # The output at a token predicts the next one of its row: kept where that one is wanted
    # (never for prefix tokens, by the choice of prefix).
    next_cols = (cols + 1).clamp(max=width - 1)
    keep = real & (seg >= 0) & (cols + 1 < lengths[rows]) & wanted[rows, next_cols]
    if recomputes_in_backward(model):
        # One dense square per packed row: each token sees its own segment and its parent.
        causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        own = seg[:, :, None] == seg[:, None, :]
        mask = (causal & (own | (parent[:, :, None] == seg[:, None, :])))[:, None]
        attention = contextlib.nullcontext()
    else:  # the kernel knows the segments; no [longest, longest] mask is made
        mask = None
        attention = attention_by_segments(model, _segments(packed, longest, device))
    with (
        attention,
        output_layer_computes_logprobs(
            model, ids[rows, next_cols], chunk_size, temperature, keep, entropy
        ),
    ):
        out = model(
            input_ids=ids[rows, cols] * real,
            position_ids=cols,
            attention_mask=mask,
            use_cache=False,
        ).logits
    # Back to the row layout: the log-prob of token (row, col + 1); the unkept ones land in a
    # spare last slot, then dropped.
    flat = torch.where(keep, rows * (width + 1) + next_cols, batch * (width + 1))
    values = out.flatten(0, 1)  # [positions] or, with the entropy, [positions, 2]
    index = flat.flatten().view(-1, *[1] * (values.dim() - 1)).expand_as(values)
    lp = values.new_zeros(batch * (width + 1) + 1, *values.shape[1:]).scatter(0, index, values)
    return lp[:-1].view(batch, width + 1, *values.shape[1:])[:, :width]
