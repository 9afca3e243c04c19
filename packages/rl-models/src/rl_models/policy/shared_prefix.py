"""Log-probs of rows that share a prompt, with the prompt run once.

A GRPO micro-batch holds several samples of one prompt: ``G`` rows whose first ``P`` tokens
are the same, and whose loss reads only the response tokens after them. A plain forward runs
the transformer over the prompt ``G`` times. Here each distinct prompt is run once, its
per-layer keys and values are copied to every row that starts with it (a KV cache, as in
generation, but with gradients: backward sums the rows' contributions into the one prompt
pass), and the rows' remaining tokens are run on top of it. The result, and its gradients,
are those of the plain forward up to float rounding; at ``G = 8`` and a prompt twice as long
as its responses the transformer does about 40 % of the work.

Which tokens are shared: a row's *prefix* is everything before the output position of its
first wanted log-prob (log p(token t) is read at position t - 1), so every wanted log-prob is
computed in the second pass. Rows whose prefixes are identical share the first pass.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

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
    Face causal LM whose output layer returns plain logits (``supports_chunked_logprobs``)."""
    ids, lengths = mb["input_ids"], mb["input_lengths"].to(mb["input_ids"].device)
    device, (batch, width) = ids.device, ids.shape
    prefix = prefix_lengths(wanted, lengths)
    firsts, group = shared_prefixes(ids, prefix)
    group_t = torch.tensor(group, device=device)
    longest = int(prefix.max())
    steps = torch.arange(width, device=device)

    # 1. Each distinct prefix once, right-padded; no output is needed from it.
    first_rows = torch.tensor(firsts, device=device, dtype=torch.long)
    prefix_real = steps[None, :longest] < prefix[first_rows][:, None]
    cache = DynamicCache(config=model.config)
    nothing = torch.zeros(len(firsts), longest, dtype=torch.bool, device=device)
    with output_layer_computes_logprobs(model, ids[first_rows, :longest], None, 1.0, nothing):
        model(
            input_ids=ids[first_rows, :longest] * prefix_real,
            attention_mask=prefix_real.long(),
            position_ids=steps[:longest].expand(len(firsts), -1),
            past_key_values=cache,
            use_cache=True,
        )
    # Every row gets its prefix's keys and values (gradients flow back through the copy); a
    # row with an empty prefix borrows the first one's, all masked out.
    cache.reorder_cache(group_t.clamp(min=0))
    prefix_mask = prefix_real[group_t.clamp(min=0)] & (group_t >= 0)[:, None]

    # 2. The rest of every row on top of its prefix: row i's positions prefix[i] .. len - 1.
    rest = lengths - prefix
    rest_width = int(rest.max())
    cols = prefix[:, None] + steps[None, :rest_width]
    rest_real = steps[None, :rest_width] < rest[:, None]
    cols = torch.where(rest_real, cols, 0)
    rest_ids = ids.gather(1, cols) * rest_real
    # The output at position t predicts token t + 1.
    next_cols = (cols + 1).clamp(max=width - 1)
    targets = ids.gather(1, next_cols)
    keep = wanted.gather(1, next_cols) & rest_real & (cols + 1 < lengths[:, None])
    with output_layer_computes_logprobs(model, targets, chunk_size, temperature, keep):
        out = model(
            input_ids=rest_ids,
            attention_mask=torch.cat([prefix_mask, rest_real], dim=1).long(),
            position_ids=cols,
            past_key_values=cache,
            use_cache=True,
        ).logits
    if cache.get_seq_length() != longest + rest_width:
        raise RuntimeError("the model did not keep the prefix's keys and values (a KV cache)")
    # Back to the row layout: out[i, j] is the log-prob of token prefix[i] + j + 1 (0 where
    # not kept); the unkept ones all land in a spare last column, then dropped.
    target_cols = torch.where(keep, next_cols, width)
    return out.new_zeros(batch, width + 1).scatter(1, target_cols, out)[:, :width]
