import itertools
import random

import pytest
import torch

from rl_distributed.packing import (
    PACKING_ALGORITHMS,
    balanced_assignment,
    first_fit,
    first_fit_decreasing,
    get_packing_algorithm,
    modified_first_fit_decreasing,
    pack_sequences,
    plan_dynamic_microbatches,
    plan_packed_microbatches,
    unpack_sequences,
)

ALGORITHMS = sorted(PACKING_ALGORITHMS)


def optimal_bin_count(lengths: list[int], capacity: int) -> int:
    """Exact minimum by exhaustive search (tiny instances only)."""
    items = sorted(lengths, reverse=True)
    best = len(items)

    def place(k: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if k == len(items):
            best = len(loads)
            return
        for b in range(len(loads)):
            if loads[b] + items[k] <= capacity:
                loads[b] += items[k]
                place(k + 1, loads)
                loads[b] -= items[k]
        place(k + 1, [*loads, items[k]])

    place(0, [])
    return best


def assert_valid_packing(bins: list[list[int]], lengths: list[int], capacity: int) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert b, "no bin is empty"
        assert sum(lengths[i] for i in b) <= capacity or len(b) == 1


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_item_lands_in_exactly_one_bin_within_capacity(name):
    rng = random.Random(0)
    pack = get_packing_algorithm(name)
    for _ in range(200):
        capacity = rng.randint(10, 200)
        # Includes zero lengths and items over the capacity, which must get bins of their own.
        lengths = [rng.randint(0, int(capacity * 1.3)) for _ in range(rng.randint(0, 40))]
        bins = pack(lengths, capacity)
        assert_valid_packing(bins, lengths, capacity)
        oversize = [i for i, n in enumerate(lengths) if n > capacity]
        assert sum(1 for b in bins if b[0] in oversize and len(b) == 1) == len(oversize)
        assert pack(lengths, capacity) == bins  # deterministic


def test_first_fit_keeps_input_order_and_ffd_sorts_first():
    lengths = [1, 6, 5, 4]
    assert first_fit(lengths, 10) == [[0, 1], [2, 3]]
    assert first_fit_decreasing(lengths, 10) == [[1, 3], [2, 0]]


def test_ffd_and_mffd_stay_within_their_worst_case_bounds_of_optimal():
    rng = random.Random(1)
    for _ in range(300):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 8))]
        opt = optimal_bin_count(lengths, 60)
        ffd = len(first_fit_decreasing(lengths, 60))
        mffd = len(modified_first_fit_decreasing(lengths, 60))
        assert opt <= ffd <= 11 / 9 * opt + 6 / 9  # Dosa (2007), tight
        assert opt <= mffd <= 71 / 60 * opt + 1  # Johnson and Garey (1985)


def test_mffd_fills_a_large_items_gap_with_two_small_items_where_ffd_cannot():
    # Capacity 60: 33 is large, 29 medium, 20/15/11 small. FFD pairs 33 with 20 and strands 9;
    # MFFD fills 33's gap with the two small items 11 + 15, leaving 29 + 20 + 9 to share a bin.
    lengths = [15, 11, 29, 20, 33, 9]
    assert first_fit_decreasing(lengths, 60) == [[4, 3], [2, 0, 1], [5]]
    assert modified_first_fit_decreasing(lengths, 60) == [[4, 1, 0], [2, 3, 5]]


def test_mffd_offers_small_items_to_the_largest_gap_first():
    # Capacity 60: large items 35 and 31, small items 16, 13, 12. Going backward, 31's gap of 29
    # takes the smallest small item (12) and then the largest that still fits (16); the leftover
    # 13 is first-fitted into 35's bin.
    lengths = [12, 35, 16, 31, 13]
    assert modified_first_fit_decreasing(lengths, 60) == [[1, 4], [3, 0, 2]]
    assert first_fit_decreasing(lengths, 60) == [[1, 2], [3, 4, 0]]


def compare_mffd_with_ffd(make_lengths, instances: int) -> tuple[int, int, int, int]:
    rng = random.Random(2)
    ffd_total = mffd_total = wins = losses = 0
    for _ in range(instances):
        lengths = make_lengths(rng)
        ffd = len(first_fit_decreasing(lengths, 1000))
        mffd = len(modified_first_fit_decreasing(lengths, 1000))
        ffd_total, mffd_total = ffd_total + ffd, mffd_total + mffd
        wins, losses = wins + (mffd < ffd), losses + (mffd > ffd)
    return ffd_total, mffd_total, wins, losses


def test_mffd_clearly_beats_ffd_when_large_items_leave_gaps_for_two_small_ones():
    def large_and_small(rng: random.Random) -> list[int]:
        large = [rng.randint(501, 700) for _ in range(rng.randint(2, 10))]
        return large + [rng.randint(167, 333) for _ in range(rng.randint(2, 20))]

    ffd_total, mffd_total, wins, losses = compare_mffd_with_ffd(large_and_small, 400)
    assert mffd_total < ffd_total
    assert wins >= 5 * max(losses, 1)  # 36 wins, 4 losses


def test_mffd_is_no_worse_than_ffd_in_aggregate_on_uniform_sizes():
    # Not on every instance: MFFD loses on 3 of these 1000 and wins on 6; both are near optimal.
    ffd_total, mffd_total, wins, losses = compare_mffd_with_ffd(
        lambda rng: [rng.randint(1, 700) for _ in range(rng.randint(5, 40))], 1000
    )
    assert mffd_total <= ffd_total
    assert wins >= losses


def test_unknown_algorithm_lists_the_choices():
    assert get_packing_algorithm("modified_first_fit_decreasing") is modified_first_fit_decreasing
    with pytest.raises(ValueError, match=r"unknown packing algorithm 'best_fit'.*first_fit"):
        get_packing_algorithm("best_fit")


@pytest.mark.parametrize("name", ALGORITHMS)
def test_packers_reject_bad_input(name):
    with pytest.raises(ValueError, match="must be positive"):
        get_packing_algorithm(name)([1, 2], 0)
    with pytest.raises(ValueError, match="non-negative"):
        get_packing_algorithm(name)([1, -2], 10)


def test_balanced_assignment_respects_counts_and_balances_weights():
    weights = [9, 8, 7, 6, 5, 4, 3, 2]
    groups = balanced_assignment(weights, [4, 4])
    assert [len(g) for g in groups] == [4, 4]
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert [sum(weights[i] for i in g) for g in groups] == [22, 22]
    # Uneven counts: the group with room takes the rest even when it is heavier.
    assert [len(g) for g in balanced_assignment([5, 1, 1], [1, 2])] == [1, 2]
    with pytest.raises(ValueError, match="do not add up to the 3 items"):
        balanced_assignment([1, 2, 3], [1, 1])


def random_lengths(rng: random.Random, n: int, longest: int) -> list[int]:
    return [min(longest, int(rng.lognormvariate(4, 1.0)) + 1) for _ in range(n)]


def test_dynamic_plan_respects_budget_and_gives_every_rank_the_same_count():
    rng = random.Random(3)
    for _ in range(50):
        lengths = random_lengths(rng, 64, 1000)
        plans = plan_dynamic_microbatches(lengths, [16] * 4, max_tokens=1024, round_to=8)
        assert len({len(p.micro_batches) for p in plans}) == 1
        assert sorted(i for p in plans for i in p.rows) == list(range(64))
        for p in plans:
            assert len(p.rows) == 16
            assert p.micro_batches[0][0] == 0 and p.micro_batches[-1][1] == 16
            for (s, e), seq_len in zip(p.micro_batches, p.seq_lengths, strict=True):
                longest = max(lengths[i] for i in p.rows[s:e])
                assert seq_len % 8 == 0 and longest <= seq_len < longest + 8
                assert (e - s) * seq_len <= 1024 or e - s == 1


def test_packed_plan_gives_every_rank_the_same_number_of_bins_within_capacity():
    rng = random.Random(4)
    for _ in range(50):
        lengths = random_lengths(rng, 80, 3000)
        plans = plan_packed_microbatches(lengths, 4, 2048, pad_multiple=16)
        assert len({len(p.micro_batches) for p in plans}) == 1
        assert sorted(i for p in plans for i in p.rows) == list(range(80))
        for p in plans:
            for (s, e), seq_len in zip(p.micro_batches, p.seq_lengths, strict=True):
                tokens = sum(-(-lengths[i] // 16) * 16 for i in p.rows[s:e])
                assert tokens <= 2048 or e - s == 1
                assert seq_len == max(lengths[i] for i in p.rows[s:e])


def test_packed_plan_deals_bins_to_balance_rank_loads():
    # Every item is over half the capacity, so each is a bin; 6 bins go 3 to each of 2 ranks.
    lengths = [100, 95, 90, 85, 80, 75]
    plans = plan_packed_microbatches(lengths, 2, capacity=100)
    loads = sorted(sum(lengths[i] for i in p.rows) for p in plans)
    best_spread = min(
        abs(sum(lengths) - 2 * sum(lengths[i] for i in trio))
        for trio in itertools.combinations(range(6), 3)
    )
    assert [len(p.micro_batches) for p in plans] == [3, 3]
    assert loads[1] - loads[0] == best_spread == 5
    for p in plans:  # heaviest bins first, so ranks step through similar loads together
        bin_loads = [sum(lengths[i] for i in p.rows[s:e]) for s, e in p.micro_batches]
        assert bin_loads == sorted(bin_loads, reverse=True)
    # FFD opens [60] before [55, 45], but the fuller bin goes first.
    (plan,) = plan_packed_microbatches([60, 55, 45], 1, capacity=100)
    assert (plan.rows, plan.micro_batches) == ([1, 2, 0], [(0, 2), (2, 3)])


def test_packed_plan_splits_bins_so_every_rank_has_one():
    plans = plan_packed_microbatches([10, 20, 30, 40, 50], 4, capacity=1000)
    assert [len(p.micro_batches) for p in plans] == [1, 1, 1, 1]
    assert sorted(i for p in plans for i in p.rows) == [0, 1, 2, 3, 4]
    with pytest.warns(RuntimeWarning, match="too few samples"):
        plans = plan_packed_microbatches([10, 20], 4, capacity=1000)
    assert sorted(len(p.rows) for p in plans) == [0, 0, 1, 1]


def padded_batch(lengths: list[int], width: int, *extra: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), width, *extra, generator=g, dtype=torch.float64)
    for b, n in enumerate(lengths):
        x[b, n:] = 0
    return x


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_pack_lays_sequences_end_to_end_and_unpack_restores_them(pad_multiple):
    lengths = [3, 0, 7, 5]
    x = padded_batch(lengths, 7, 2)
    packed = pack_sequences(x, lengths, pad_multiple=pad_multiple, pad_value=-1.0)

    expected, positions, starts = [], [], [0]
    for b, n in enumerate(lengths):
        slot = -(-n // pad_multiple) * pad_multiple
        expected += [
            x[b, t] if t < n else torch.full((2,), -1.0, dtype=x.dtype) for t in range(slot)
        ]
        positions += list(range(slot))
        starts.append(starts[-1] + slot)
    assert torch.equal(packed.input_ids, torch.stack(expected).unsqueeze(0))
    assert packed.position_ids.tolist() == [positions]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == starts

    restored = unpack_sequences(packed.input_ids, packed.cu_seqlens, lengths, max_len=7)
    assert restored.dtype == torch.float64
    assert torch.equal(restored, x)


def test_unpack_pads_to_max_len_and_round_trips_token_ids():
    ids = torch.tensor([[5, 6, 0, 0], [7, 8, 9, 1]])
    packed = pack_sequences(ids, torch.tensor([2, 4]), pad_multiple=3)
    assert packed.input_ids.tolist() == [[5, 6, 0, 7, 8, 9, 1, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5]]
    out = unpack_sequences(packed.input_ids, packed.cu_seqlens, [2, 4], max_len=6, pad_value=-1)
    assert out.tolist() == [[5, 6, -1, -1, -1, -1], [7, 8, 9, 1, -1, -1]]


def test_pack_and_unpack_reject_inconsistent_shapes():
    with pytest.raises(ValueError, match="exceeds the padded width 2"):
        pack_sequences(torch.zeros(2, 2), [1, 3])
    with pytest.raises(ValueError, match="expected 2 lengths"):
        pack_sequences(torch.zeros(2, 2), [1])
    packed = pack_sequences(torch.ones(2, 3), [1, 3])
    with pytest.raises(ValueError, match="cu_seqlens ends at 4 but the packed row has 3"):
        unpack_sequences(packed.input_ids[:, :3], packed.cu_seqlens, [1, 3], 3)
    with pytest.raises(ValueError, match="exceeds its packed segment or max_len"):
        unpack_sequences(packed.input_ids, packed.cu_seqlens, [2, 2], 3)
