"""Bin packing of sequences into token budgets, micro-batch planning, and packed-row helpers.

Three layers, from pure to tensor-level:

- Bin packers (``first_fit``, ``first_fit_decreasing``, ``modified_first_fit_decreasing``) map a
  list of lengths and a capacity to bins (lists of item indices). ``PACKING_ALGORITHMS`` and
  ``get_packing_algorithm`` look them up by name.
- Planners (``plan_dynamic_microbatches``, ``plan_packed_microbatches``) turn the lengths of one
  global batch into per-rank plans: which samples each data-parallel rank gets, in what order,
  and where its micro-batches begin and end. Every rank gets the same number of micro-batches,
  because ranks run collectives once per micro-batch.
- ``pack_sequences`` / ``unpack_sequences`` turn a micro-batch of right-padded sequences into one
  packed row (with restarting position ids and ``cu_seqlens`` for varlen attention) and back.
"""

from __future__ import annotations

import bisect
import heapq
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rl_distributed._torch import missing_torch

try:
    import torch
except ImportError as err:
    raise missing_torch("rl_distributed.packing (used by BatchedDataDict)") from err

PackingAlgorithm = Callable[[Sequence[int], int], list[list[int]]]


def _check_lengths(lengths: Sequence[int], capacity: int) -> list[int]:
    if capacity < 1:
        raise ValueError(f"the token budget per bin/micro-batch must be positive, got {capacity}")
    out = [int(n) for n in lengths]
    if any(n < 0 for n in out):
        raise ValueError(f"lengths must be non-negative, got {min(out)}")
    return out


def _decreasing(lengths: Sequence[int]) -> list[int]:
    """Indices by decreasing length; ties keep input order so results are deterministic."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


class _FirstFitBins:
    """Open bins plus a max-tree over their free space, so "first bin with room" is O(log n)."""

    def __init__(self, capacity: int, max_bins: int) -> None:
        self.capacity = capacity
        self.bins: list[list[int]] = []
        self._leaves = 1 << max(0, max_bins - 1).bit_length()
        # -1 marks bins not yet opened: no item (length >= 0) can ever go there.
        self._free = [-1] * (2 * self._leaves)

    def free(self, b: int) -> int:
        return self._free[self._leaves + b]

    def _set_free(self, b: int, free: int) -> None:
        node = self._leaves + b
        self._free[node] = free
        while node > 1:
            node //= 2
            self._free[node] = max(self._free[2 * node], self._free[2 * node + 1])

    def open(self, item: int, size: int) -> int:
        self.bins.append([item])
        self._set_free(len(self.bins) - 1, self.capacity - size)
        return len(self.bins) - 1

    def add(self, b: int, item: int, size: int) -> None:
        self.bins[b].append(item)
        self._set_free(b, self.free(b) - size)

    def first_fit(self, item: int, size: int) -> None:
        """Put the item in the lowest-numbered bin with room, or in a new bin."""
        if self._free[1] < size:
            self.open(item, size)
            return
        node = 1
        while node < self._leaves:
            node = 2 * node if self._free[2 * node] >= size else 2 * node + 1
        self.add(node - self._leaves, item, size)


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items in the given order, each into the first bin with room (a new one if none).

    An item longer than ``capacity`` gets a bin of its own. Returns bins as lists of indices
    into ``lengths``, in the order the bins were opened.
    """
    lengths = _check_lengths(lengths, capacity)
    bins = _FirstFitBins(capacity, len(lengths))
    for i, n in enumerate(lengths):
        bins.first_fit(i, n)
    return bins.bins


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First fit over the items sorted by decreasing length (FFD).

    Uses at most 11/9 OPT + 6/9 bins. Same output format as ``first_fit``.
    """
    lengths = _check_lengths(lengths, capacity)
    bins = _FirstFitBins(capacity, len(lengths))
    for i in _decreasing(lengths):
        bins.first_fit(i, lengths[i])
    return bins.bins


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Johnson and Garey's modified first fit decreasing (MFFD), bound 71/60 OPT + 1.

    Items are classed by size relative to the capacity C: large (> C/2), medium (C/3, C/2],
    small (C/6, C/3] and the rest. FFD puts the large items first and then fills their gaps in
    decreasing order, which wastes gaps that one medium item cannot fill but two small ones
    could. MFFD instead:

    1. opens one bin per large item, largest first;
    2. going forward (smallest gap first), gives each large bin the largest medium item that
       fits;
    3. going backward (largest gap first), gives each large bin still without a medium item
       the smallest small item plus the largest small item that fits beside it, provided two
       small items fit at all;
    4. first-fits everything left in decreasing order, into these bins first and then new ones.

    Same output format as ``first_fit``.
    """
    lengths = _check_lengths(lengths, capacity)
    order = _decreasing(lengths)
    large = [i for i in order if 2 * lengths[i] > capacity]
    # Medium and small items as ascending (length, index) pairs, for bisection.
    medium = sorted((lengths[i], i) for i in order if 3 * lengths[i] > capacity >= 2 * lengths[i])
    small = sorted((lengths[i], i) for i in order if 6 * lengths[i] > capacity >= 3 * lengths[i])

    def take_largest_fitting(pool: list[tuple[int, int]], room: int) -> tuple[int, int]:
        # Callers have checked that pool[0] fits, so the result is never pool[-1] by wrap-around.
        return pool.pop(bisect.bisect_right(pool, (room, len(lengths))) - 1)

    bins = _FirstFitBins(capacity, len(lengths))
    for i in large:
        bins.open(i, lengths[i])
    for b in range(len(large)):
        if medium and medium[0][0] <= bins.free(b):
            n, i = take_largest_fitting(medium, bins.free(b))
            bins.add(b, i, n)
    # A bin holding a large and a medium item has less than C/6 left, so this skips it.
    for b in reversed(range(len(large))):
        if len(small) < 2 or small[0][0] + small[1][0] > bins.free(b):
            continue
        n, i = small.pop(0)
        bins.add(b, i, n)
        n, i = take_largest_fitting(small, bins.free(b))
        bins.add(b, i, n)

    placed = {i for bin_ in bins.bins for i in bin_}
    for i in order:
        if i not in placed:
            bins.first_fit(i, lengths[i])
    return bins.bins


PACKING_ALGORITHMS: dict[str, PackingAlgorithm] = {
    "first_fit": first_fit,
    "first_fit_decreasing": first_fit_decreasing,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
}


def get_packing_algorithm(name: str) -> PackingAlgorithm:
    """The bin packer registered under ``name`` in ``PACKING_ALGORITHMS``."""
    try:
        return PACKING_ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown packing algorithm {name!r}; choose one of {sorted(PACKING_ALGORITHMS)}"
        ) from None


def balanced_assignment(weights: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """Deal items to groups so that group ``g`` gets exactly ``counts[g]`` items and the groups'
    weight sums are balanced.

    Greedy longest-processing-time: items in decreasing weight go to the lightest group that
    still has room (ties to the lower group). Returns each group's item indices in the order
    they were dealt, i.e. by decreasing weight.
    """
    if sum(counts) != len(weights):
        raise ValueError(f"counts {list(counts)} do not add up to the {len(weights)} items")
    groups: list[list[int]] = [[] for _ in counts]
    heap = [(0, g) for g, c in enumerate(counts) if c > 0]
    heapq.heapify(heap)
    for i in _decreasing(weights):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        if len(groups[g]) < counts[g]:
            heapq.heappush(heap, (load + weights[i], g))
    return groups


@dataclass(frozen=True)
class ShardPlan:
    """One data-parallel rank's part of a global batch.

    ``rows`` are indices into the global batch, in the order the rank stores them;
    ``micro_batches`` are ``(start, end)`` ranges into ``rows``, contiguous and covering it;
    ``seq_lengths`` give, per micro-batch, the sequence length its padded tensors are cut to.
    """

    rows: list[int]
    micro_batches: list[tuple[int, int]]
    seq_lengths: list[int]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _split_until(
    groups: list[list[int]],
    target: int,
    weight: Callable[[list[int]], int],
    split: Callable[[list[int]], tuple[list[int], list[int]]],
) -> list[list[int]]:
    """Split the heaviest splittable group in two until there are ``target`` groups.

    When no group has two items left, pads with empty groups (and warns): a rank with too few
    samples must still take part in every micro-batch step.
    """
    groups = list(groups)
    while len(groups) < target:
        splittable = [g for g in range(len(groups)) if len(groups[g]) >= 2]
        if not splittable:
            warnings.warn(
                f"too few samples to give every rank {target} non-empty micro-batches; "
                "adding empty ones",
                RuntimeWarning,
                stacklevel=3,
            )
            groups += [[] for _ in range(target - len(groups))]
            break
        g = max(splittable, key=lambda g: (weight(groups[g]), -g))
        groups[g : g + 1] = split(groups[g])
    return groups


def _to_plan(groups: list[list[int]], seq_length: Callable[[list[int]], int]) -> ShardPlan:
    rows: list[int] = []
    bounds = []
    for group in groups:
        bounds.append((len(rows), len(rows) + len(group)))
        rows += group
    return ShardPlan(rows, bounds, [seq_length(g) for g in groups])


def plan_dynamic_microbatches(
    lengths: Sequence[int],
    shard_sizes: Sequence[int],
    max_tokens: int,
    round_to: int = 1,
) -> list[ShardPlan]:
    """Plan dynamic batching of one global batch over ``len(shard_sizes)`` ranks.

    Samples go to ranks balancing token counts, rank ``r`` getting ``shard_sizes[r]`` of them.
    Each rank sorts its samples by decreasing length and cuts them greedily into micro-batches
    whose padded cost, ``n_samples * round_up(max_length, round_to)``, stays within
    ``max_tokens`` (a sample over the budget alone is a micro-batch of its own). Ranks with
    fewer micro-batches than the busiest one split their largest micro-batches so all ranks
    have the same count. ``seq_lengths`` hold each micro-batch's rounded max length.
    """
    lengths = _check_lengths(lengths, max_tokens)
    if round_to < 1:
        raise ValueError(f"sequence_length_round must be >= 1, got {round_to}")
    padded = [_round_up(n, round_to) for n in lengths]

    def cut(rows: list[int]) -> list[list[int]]:
        groups: list[list[int]] = []
        for i in rows:  # decreasing length: a micro-batch's first row sets its padded length
            if groups and (len(groups[-1]) + 1) * padded[groups[-1][0]] <= max_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    per_shard = [cut(rows) for rows in balanced_assignment(lengths, shard_sizes)]
    target = max(len(groups) for groups in per_shard)
    return [
        _to_plan(
            _split_until(groups, target, len, lambda g: (g[: len(g) // 2], g[len(g) // 2 :])),
            lambda g: max((padded[i] for i in g), default=0),
        )
        for groups in per_shard
    ]


def plan_packed_microbatches(
    lengths: Sequence[int],
    shards: int,
    capacity: int,
    algorithm: str = "first_fit_decreasing",
    pad_multiple: int = 1,
) -> list[ShardPlan]:
    """Plan sequence packing of one global batch over ``shards`` ranks.

    Each length is rounded up to ``pad_multiple`` and the samples are bin-packed into bins of
    ``capacity`` tokens (a sample over the capacity gets a bin of its own). If the bin count is
    not a multiple of ``shards``, the fullest bins are split in two until it is. Bins are dealt
    to ranks balancing tokens, each rank getting the same number, and each rank orders its bins
    by decreasing load so that ranks work on similar loads at the same step. Each bin is one
    micro-batch; ``seq_lengths`` hold its longest (unrounded) sample length.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if pad_multiple < 1:
        raise ValueError(f"sequence_length_pad_multiple must be >= 1, got {pad_multiple}")
    lengths = _check_lengths(lengths, capacity)
    padded = [_round_up(n, pad_multiple) for n in lengths]
    bins = get_packing_algorithm(algorithm)(padded, capacity)

    def load(bin_: list[int]) -> int:
        return sum(padded[i] for i in bin_)

    def halve(bin_: list[int]) -> tuple[list[int], list[int]]:
        halves = balanced_assignment(
            [padded[i] for i in bin_], [len(bin_) - len(bin_) // 2, len(bin_) // 2]
        )
        return [bin_[i] for i in halves[0]], [bin_[i] for i in halves[1]]

    bins = _split_until(bins, max(shards, _round_up(len(bins), shards)), load, halve)
    loads = [load(b) for b in bins]
    dealt = balanced_assignment(loads, [len(bins) // shards] * shards)
    return [
        _to_plan(
            [bins[b] for b in sorted(owned, key=lambda b: (-loads[b], b))],
            lambda g: max((lengths[i] for i in g), default=0),
        )
        for owned in dealt
    ]


@dataclass
class PackedSequences:
    """A micro-batch packed into one row.

    ``input_ids`` is ``[1, T, ...]``; ``position_ids`` is ``[1, T]`` and restarts at 0 for every
    sequence; ``cu_seqlens`` (int32, ``[B + 1]``) holds the offsets where sequences start, with
    ``T`` last, in the form varlen attention kernels take.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor


def _lengths_tensor(lengths: torch.Tensor | Sequence[int], batch: int) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
    if lengths.shape != (batch,):
        raise ValueError(f"expected {batch} lengths, got shape {tuple(lengths.shape)}")
    if (lengths < 0).any():
        raise ValueError("lengths must be non-negative")
    return lengths


def _real_tokens(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every real token, in order: its sequence and its position in that sequence."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return seq, torch.arange(len(seq)) - starts.index_select(0, seq)


# The copies below gather and scatter whole rows with index_select / index_copy_ on flattened
# views: one integer index per token, which is fast on any device (boolean masks are not).


def pack_sequences(
    input_ids: torch.Tensor,
    lengths: torch.Tensor | Sequence[int],
    pad_multiple: int = 1,
    pad_value: int | float = 0,
) -> PackedSequences:
    """Concatenate the first ``lengths[b]`` entries of each row of ``input_ids`` (``[B, S, ...]``)
    into one row.

    Each sequence's slot is rounded up to a multiple of ``pad_multiple`` (for tensor- or
    context-parallel sharding of the packed row) and the slack filled with ``pad_value``; the
    padding tokens get positions and belong to their sequence's ``cu_seqlens`` segment, after
    its real tokens, so causal attention keeps them out of the real tokens' view.
    """
    if input_ids.ndim < 2:
        raise ValueError(f"input_ids must be [B, S, ...], got shape {tuple(input_ids.shape)}")
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    batch, width, *rest = input_ids.shape
    lengths = _lengths_tensor(lengths, batch)
    if (lengths > width).any():
        raise ValueError(f"a length of {int(lengths.max())} exceeds the padded width {width}")
    slots = (lengths + pad_multiple - 1) // pad_multiple * pad_multiple
    starts = torch.cumsum(slots, 0) - slots
    total = int(slots.sum())
    seq, pos = _real_tokens(lengths)
    device = input_ids.device
    src, dst = (seq * width + pos).to(device), (starts.index_select(0, seq) + pos).to(device)
    packed = input_ids.new_full((total, *rest), pad_value)
    packed.index_copy_(0, dst, input_ids.reshape(batch * width, *rest).index_select(0, src))
    # Positions restart at 0 in every slot, padding included.
    slot_of = torch.repeat_interleave(torch.arange(batch), slots)
    position_ids = torch.arange(total) - starts.index_select(0, slot_of)
    cu_seqlens = torch.cat([starts, slots.sum().reshape(1)]).to(torch.int32)
    return PackedSequences(
        input_ids=packed.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0).to(device),
        cu_seqlens=cu_seqlens.to(device),
    )


def unpack_sequences(
    packed_values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lengths: torch.Tensor | Sequence[int],
    max_len: int,
    pad_value: int | float = 0,
) -> torch.Tensor:
    """Undo ``pack_sequences`` on per-token values (``[1, T, ...]``, e.g. logits or logprobs).

    Returns ``[B, max_len, ...]`` with sequence ``b``'s first ``lengths[b]`` values, right-padded
    with ``pad_value``.
    """
    if packed_values.ndim < 2 or packed_values.shape[0] != 1:
        raise ValueError(f"packed_values must be [1, T, ...], got {tuple(packed_values.shape)}")
    cu = torch.as_tensor(cu_seqlens).long().cpu()
    batch, rest = cu.numel() - 1, packed_values.shape[2:]
    lengths = _lengths_tensor(lengths, batch)
    if int(cu[-1]) != packed_values.shape[1]:
        raise ValueError(
            f"cu_seqlens ends at {int(cu[-1])} but the packed row has {packed_values.shape[1]} tokens"
        )
    if (lengths > cu.diff()).any() or (lengths > max_len).any():
        raise ValueError("a length exceeds its packed segment or max_len")
    seq, pos = _real_tokens(lengths)
    device = packed_values.device
    src, dst = (cu.index_select(0, seq) + pos).to(device), (seq * max_len + pos).to(device)
    out = packed_values.new_full((batch * max_len, *rest), pad_value)
    out.index_copy_(0, dst, packed_values[0].index_select(0, src))
    return out.reshape(batch, max_len, *rest)
