"""Log-probs of rows that share a prompt, with the prompt run once.

A GRPO micro-batch holds several samples of one prompt: ``G`` rows whose first ``P`` tokens
are the same, and whose loss reads only the response tokens after them. A plain forward runs
the transformer over the prompt ``G`` times. Here each distinct prompt is run once and every
row's remaining tokens attend to it: one packed row (the prompts, then each row's rest) under
a block mask. Backward sums the rows' contributions into the one prompt pass. Log-probs and
gradients are those of the plain forward up to float rounding; at ``G = 8`` and a prompt
twice as long as its responses the transformer does about 40 % of the work.

Which tokens are shared: a row's *prefix* is everything before the output position of its
first wanted log-prob (log p(token t) is read at position t - 1), so every wanted log-prob is
read from the row's own remaining tokens. Rows whose prefixes are identical share one copy.
"""

from __future__ import annotations

import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.policy.logprobs import output_layer_computes_logprobs


def prefix_lengths(wanted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` tokens before the position that predicts each row's first wanted token (0 for
    a row with nothing wanted: it has nothing to share)."""
    any_wanted = wanted.any(dim=1)
    first = wanted.to(torch.uint8).argmax(dim=1)
    return torch.where(any_wanted, (first - 1).clamp(min=0), 0).clamp(max=lengths - 1)


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


def worth_sharing(wanted: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether some prefix is shared by two rows at all (else the plain forward is as good)."""
    prefix = prefix_lengths(wanted, lengths)
    firsts, group = shared_prefixes(ids, prefix)
    return len(firsts) < sum(g >= 0 for g in group)


def shared_prefix_logprobs(
    model: torch.nn.Module,
    mb: BatchedDataDict,
    wanted: torch.Tensor,
    chunk_size: int | None,
    temperature: float,
) -> torch.Tensor:
    """``[B, S]`` log-probs at the ``wanted`` positions (0 elsewhere) of a right-padded
    micro-batch, each distinct prefix run once (module docstring). ``model`` is a Hugging
    Face causal LM with a dense-mask attention kernel (sdpa, eager) whose output layer returns
    plain logits (``supports_chunked_logprobs``).

    One forward pass over one packed row: the distinct prefixes, then every row's remaining
    tokens, with a mask that lets each remaining token see its own row's earlier remaining
    tokens and its prefix (one call, so FSDP2 and activation checkpointing see an ordinary
    forward).
    """
    ids, lengths = mb["input_ids"], mb["input_lengths"].to(mb["input_ids"].device)
    device, (batch, width) = ids.device, ids.shape
    prefix = prefix_lengths(wanted, lengths)
    firsts, group = shared_prefixes(ids, prefix)
    # Where each token of the packed row comes from, its segment (a prefix, or a row's rest)
    # and, for a rest, the segment of its prefix (-1: none).
    rows, cols, segment, parent = [], [], [], []
    for u, i in enumerate(firsts):
        p = int(prefix[i])
        rows += [i] * p
        cols += range(p)
        segment += [u] * p
        parent += [-1] * p
    for i in range(batch):
        start, end = int(prefix[i]), int(lengths[i])
        rows += [i] * (end - start)
        cols += range(start, end)
        segment += [len(firsts) + i] * (end - start)
        parent += [group[i]] * (end - start)
    rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
    seg, par = torch.tensor(segment, device=device), torch.tensor(parent, device=device)
    order = torch.arange(len(rows), device=device)
    causal = order[None, :] <= order[:, None]
    mask = (causal & (seg[:, None] == seg[None, :])) | (par[:, None] == seg[None, :])
    # The output at a token predicts the next one of its row: kept where that one is wanted
    # (never for prefix tokens, by the choice of prefix).
    next_cols = (cols_t + 1).clamp(max=width - 1)
    keep = wanted[rows_t, next_cols] & (cols_t + 1 < lengths[rows_t]) & (seg >= len(firsts))
    with output_layer_computes_logprobs(
        model, ids[rows_t, next_cols][None], chunk_size, temperature, keep[None]
    ):
        out = model(
            input_ids=ids[rows_t, cols_t][None],
            position_ids=cols_t[None],
            attention_mask=mask[None, None],
            use_cache=False,
        ).logits[0]
    # Back to the row layout: the log-prob of token (row, col + 1); the unkept ones land in a
    # spare last column, then dropped.
    flat = torch.where(keep, rows_t * (width + 1) + next_cols, batch * (width + 1))
    lp = out.new_zeros(batch * (width + 1) + 1).scatter(0, flat, out)
    return lp[:-1].view(batch, width + 1)[:, :width]
