import pickle
import random

import numpy as np
import pytest
import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.packing import pack_sequences, unpack_sequences


def make_batch(lengths: list[int], width: int | None = None, seed: int = 0) -> BatchedDataDict:
    """Right-padded token ids plus per-sample values of every supported kind."""
    width = width or max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (len(lengths), width), generator=g)
    ids[torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]] = 0
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor(lengths),
        advantages=torch.randn(len(lengths), generator=g, dtype=torch.float64),
        sample_id=list(range(len(lengths))),
        reward=np.arange(len(lengths), dtype=np.float64) / 10,
    )


def random_lengths(n: int, longest: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(longest, int(rng.lognormvariate(4, 1.0)) + 1) for _ in range(n)]


def assert_same(a: BatchedDataDict, b: BatchedDataDict) -> None:
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        elif isinstance(a[key], np.ndarray):
            np.testing.assert_array_equal(a[key], b[key])
        else:
            assert a[key] == b[key], key


# ---- construction and basic access ---------------------------------------------------------


def test_size_is_the_shared_batch_dimension():
    batch = make_batch([3, 1, 2])
    assert batch.size == 3
    assert BatchedDataDict().size == 0
    batch["bad"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"disagree on the batch size: .*'bad': 2"):
        _ = batch.size


def test_unsupported_values_are_rejected_naming_the_key():
    with pytest.raises(TypeError, match=r"key 'x': values must be.*got int"):
        BatchedDataDict(x=3)
    with pytest.raises(ValueError, match="key 'y': a 0-d value"):
        BatchedDataDict(y=torch.tensor(1.0))


def test_get_dict_is_a_plain_dict_of_the_same_values():
    batch = make_batch([2, 1])
    plain = batch.get_dict()
    assert type(plain) is dict and plain.keys() == batch.keys()
    assert plain["input_ids"] is batch["input_ids"]
    plain["extra"] = [1, 2]
    assert "extra" not in batch


def test_from_batches_pads_tensors_and_arrays_and_joins_lists():
    a = BatchedDataDict(
        ids=torch.tensor([[1, 2]]), mask=np.ones((1, 2)), tags=["a"], logp=torch.ones(1, 2, 3)
    )
    b = {
        "ids": torch.tensor([[3, 4, 5], [6, 0, 0]]),
        "mask": np.ones((2, 1)),
        "tags": ["b", "c"],
        "logp": torch.ones(2, 1, 4),
    }
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"ids": -1})
    assert isinstance(out, BatchedDataDict)
    assert out["ids"].tolist() == [[1, 2, -1], [3, 4, 5], [6, 0, 0]]
    np.testing.assert_array_equal(out["mask"], [[1, 1], [1, 0], [1, 0]])
    assert out["tags"] == ["a", "b", "c"]
    assert out["logp"].shape == (3, 2, 4)
    assert out["logp"].sum().item() == 1 * 2 * 3 + 2 * 1 * 4  # padding is zeros by default


def test_from_batches_rejects_mismatched_batches():
    with pytest.raises(ValueError, match="at least one batch"):
        BatchedDataDict.from_batches([])
    with pytest.raises(ValueError, match=r"batch 1 .*missing \['y'\], extra \['z'\]"):
        BatchedDataDict.from_batches([{"x": [1], "y": [2]}, {"x": [1], "z": [2]}])
    with pytest.raises(ValueError, match="key 'x' holds different types"):
        BatchedDataDict.from_batches([{"x": [1]}, {"x": torch.ones(1)}])
    with pytest.raises(ValueError, match="key 'x' has different numbers of dims"):
        BatchedDataDict.from_batches([{"x": torch.ones(1)}, {"x": torch.ones(1, 2)}])


# ---- row selection -------------------------------------------------------------------------


def test_slice_and_select_indices_pick_rows_of_every_value_kind():
    batch = make_batch([4, 2, 3, 1, 5])
    part = batch.slice(1, 3)
    assert part["sample_id"] == [1, 2] and part["reward"].tolist() == [0.1, 0.2]
    assert torch.equal(part["input_ids"], batch["input_ids"][1:3])
    for idx in ([4, 0, 0], torch.tensor([4, 0, 0]), np.array([4, 0, 0])):
        picked = batch.select_indices(idx)
        assert picked["sample_id"] == [4, 0, 0]
        assert torch.equal(picked["advantages"], batch["advantages"][[4, 0, 0]])
        assert picked["reward"].tolist() == [0.4, 0.0, 0.0]
    assert batch.select_indices([]).size == 0
    with pytest.raises(IndexError, match="index 5 is out of range for a batch of 5"):
        batch.select_indices([0, 5])
    with pytest.raises(TypeError, match="boolean mask"):
        batch.select_indices(torch.ones(5, dtype=torch.bool))


def test_chunk_returns_contiguous_equal_parts():
    batch = make_batch([1] * 6)
    assert [batch.chunk(r, 3)["sample_id"] for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="6 cannot be split into 4 equal chunks"):
        batch.chunk(0, 4)
    with pytest.raises(ValueError, match="rank 3 is out of range for 3 chunks"):
        batch.chunk(3, 3)


def test_get_batch_and_microbatch_iterator_walk_consecutive_rows():
    batch = make_batch([1] * 5)
    assert batch.get_batch(1, 2)["sample_id"] == [2, 3]
    assert batch.get_batch(2, 2)["sample_id"] == [4]
    with pytest.raises(IndexError, match="batch 3 of size 2 is out of range for 5 rows"):
        batch.get_batch(3, 2)
    assert [mb["sample_id"] for mb in batch.make_microbatch_iterator(2)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="microbatch_size must be >= 1"):
        next(batch.make_microbatch_iterator(0))


def test_repeat_interleave_repeats_each_sample_consecutively():
    batch = make_batch([2, 3])
    out = batch.repeat_interleave(3)
    assert out["sample_id"] == [0, 0, 0, 1, 1, 1]
    assert out["reward"].tolist() == [0.0, 0.0, 0.0, 0.1, 0.1, 0.1]
    assert torch.equal(out["input_ids"][3:], batch["input_ids"][[1, 1, 1]])
    assert batch.size == 2  # the original is untouched
    with pytest.raises(ValueError, match="non-negative"):
        batch.repeat_interleave(-1)


def test_reorder_data_permutes_in_place():
    batch = make_batch([1, 2, 3])
    ids = batch["input_ids"].clone()
    assert batch.reorder_data([2, 0, 1]) is batch
    assert batch["sample_id"] == [2, 0, 1]
    assert torch.equal(batch["input_ids"], ids[[2, 0, 1]])
    with pytest.raises(ValueError, match=r"permutation of range\(3\)"):
        batch.reorder_data([0, 0, 1])


def test_truncate_tensors_cuts_only_values_with_that_dim():
    batch = make_batch([3, 4], width=6)
    batch["logp"] = torch.ones(2, 6, 5)
    ids = batch["input_ids"].clone()
    assert batch.truncate_tensors(dim=1, length=4) is batch
    assert torch.equal(batch["input_ids"], ids[:, :4])
    assert batch["logp"].shape == (2, 4, 5)
    assert batch["advantages"].shape == (2,) and batch["sample_id"] == [0, 1]
    batch.truncate_tensors(dim=2, length=2)
    assert batch["logp"].shape == (2, 4, 2) and batch["input_ids"].shape == (2, 4)
    with pytest.raises(ValueError, match="dim 0 is the batch"):
        batch.truncate_tensors(dim=0, length=1)


def test_to_moves_tensors_in_place_and_keeps_the_plan():
    batch = make_batch([5, 3, 8, 2])
    batch["ids32"] = batch["input_ids"].to(torch.int32)
    shards, _ = batch.shard_by_batch_size(2, dynamic_batching_args=DYNAMIC)
    moved = shards[0].to("meta")  # a real second device, available without an accelerator
    assert moved is shards[0]
    assert moved["input_ids"].is_meta and moved["advantages"].is_meta
    assert moved["ids32"].dtype == torch.int32
    assert isinstance(moved["reward"], np.ndarray) and moved["sample_id"] == [2, 3]
    assert moved.micro_batch_indices is not None and moved.micro_batch_kind == "dynamic"


# ---- plain sharding ------------------------------------------------------------------------


def test_each_shard_gets_its_chunk_of_every_global_batch_in_order():
    batch = make_batch([1] * 8)
    shards = batch.shard_by_batch_size(2, batch_size=4)
    assert [s["sample_id"] for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [s["sample_id"] for s in batch.shard_by_batch_size(4)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]


def test_uneven_shards_give_the_first_shards_one_more_sample():
    batch = make_batch([1] * 10)
    with pytest.raises(ValueError, match=r"5 is not divisible by 2 shards.*allow_uneven_shards"):
        batch.shard_by_batch_size(2, batch_size=5)
    shards = batch.shard_by_batch_size(3, batch_size=5, allow_uneven_shards=True)
    assert [s["sample_id"] for s in shards] == [[0, 1, 5, 6], [2, 3, 7, 8], [4, 9]]


def test_sharding_rejects_inconsistent_sizes():
    batch = make_batch([1] * 6)
    with pytest.raises(ValueError, match="6 rows is not divisible into global batches of 4"):
        batch.shard_by_batch_size(2, batch_size=4)
    with pytest.raises(ValueError, match="cannot shard an empty batch"):
        BatchedDataDict(x=[]).shard_by_batch_size(2)
    with pytest.raises(ValueError, match="not both"):
        batch.shard_by_batch_size(2, dynamic_batching_args=DYNAMIC, sequence_packing_args=PACKING)
    with pytest.raises(ValueError, match="shards must be >= 1"):
        batch.shard_by_batch_size(0)


# ---- dynamic batching ----------------------------------------------------------------------

DYNAMIC = {
    "input_key": "input_ids",
    "input_lengths_key": "input_lengths",
    "max_tokens_per_microbatch": 256,
    "sequence_length_round": 8,
}
PACKING = {
    "input_key": "input_ids",
    "input_lengths_key": "input_lengths",
    "max_tokens_per_microbatch": 256,
    "sequence_length_pad_multiple": 4,
}


def fake_per_token_output(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Stands in for a model: a per-token float64 value of token and position, zero on padding."""
    positions = torch.arange(ids.shape[1], dtype=torch.float64)
    real = positions[None, :] < lengths[:, None]
    return torch.where(real, ids.to(torch.float64) * 0.5 + positions, 0.0)


def check_restores_original_order(batch, shards, restore, outputs_per_shard) -> None:
    merged = BatchedDataDict.from_batches(
        [BatchedDataDict.from_batches(outs) for outs in outputs_per_shard]
    ).reorder_data(restore)
    assert merged["sample_id"] == batch["sample_id"]
    expected = fake_per_token_output(batch["input_ids"], batch["input_lengths"])
    width = merged["logp"].shape[1]
    assert torch.equal(merged["logp"], expected[:, :width])
    assert not expected[:, width:].any()  # anything cut off was padding


@pytest.mark.parametrize("batch_size", [None, 16])
def test_dynamic_shards_restore_the_original_order(batch_size):
    batch = make_batch(random_lengths(48, 200, seed=1), width=208)
    shards, restore = batch.shard_by_batch_size(
        4, batch_size=batch_size, dynamic_batching_args=DYNAMIC
    )
    outputs = [
        [
            BatchedDataDict(
                logp=fake_per_token_output(mb["input_ids"], mb["input_lengths"]),
                sample_id=mb["sample_id"],
            )
            for mb in shard.make_microbatch_iterator_with_dynamic_shapes()
        ]
        for shard in shards
    ]
    check_restores_original_order(batch, shards, restore, outputs)
    # Shards keep plain sharding's sizes, and global batch g only holds rows of global batch g.
    size = batch_size or 48
    assert [s.size for s in shards] == [12] * 4
    for shard in shards:
        for g, bounds in enumerate(shard.micro_batch_indices):
            rows = shard["sample_id"][bounds[0][0] : bounds[-1][1]]
            assert len(rows) == size // 4 and all(g * size <= i < (g + 1) * size for i in rows)


def test_dynamic_microbatches_respect_the_budget_and_match_across_shards():
    batch = make_batch(random_lengths(64, 300, seed=2), width=304)
    batch["features"] = torch.randn(64, 512)  # 2-d but not a sequence: never cut
    shards, _ = batch.shard_by_batch_size(4, batch_size=32, dynamic_batching_args=DYNAMIC)
    for g in range(2):
        assert len({len(s.micro_batch_indices[g]) for s in shards}) == 1
    for shard in shards:
        microbatches = list(shard.make_microbatch_iterator_with_dynamic_shapes())
        lengths = [n for per_g in shard.micro_batch_lengths for n in per_g]
        assert len(microbatches) == len(lengths)
        for mb, padded in zip(microbatches, lengths, strict=True):
            longest = int(mb["input_lengths"].max())
            assert padded % 8 == 0 and longest <= padded < longest + 8
            assert mb["input_ids"].shape == (mb.size, padded)
            assert mb.size * padded <= 256 or mb.size == 1
            assert mb["advantages"].shape == (mb.size,)
            assert mb["features"].shape == (mb.size, 512)


@pytest.mark.parametrize("order", ["shuffled", "sorted"])
def test_dynamic_sharding_balances_tokens_across_shards(order):
    lengths = random_lengths(64, 300, seed=3)
    if order == "sorted":  # the worst case for contiguous chunks
        lengths.sort()
    batch = make_batch(lengths)
    shards, _ = batch.shard_by_batch_size(4, dynamic_batching_args=DYNAMIC)
    tokens = [int(s["input_lengths"].sum()) for s in shards]
    naive = [int(s["input_lengths"].sum()) for s in batch.shard_by_batch_size(4)]
    assert sum(tokens) == sum(lengths)
    assert max(tokens) - min(tokens) <= max(lengths) / 10
    assert max(tokens) - min(tokens) < (max(naive) - min(naive)) / 5


def test_a_sample_over_the_budget_is_a_microbatch_of_its_own():
    batch = make_batch([300, 10, 20, 5], width=300)
    shards, _ = batch.shard_by_batch_size(1, dynamic_batching_args=DYNAMIC)
    sizes = [mb.size for mb in shards[0].make_microbatch_iterator_with_dynamic_shapes()]
    assert shards[0].micro_batch_indices == [[(0, 1), (1, 4)]]
    # Rounding 300 up to 304 would exceed the stored width, so it is capped there.
    assert shards[0].micro_batch_lengths == [[300, 24]]
    assert sizes == [1, 3]


def test_too_few_samples_give_a_shard_an_empty_microbatch_with_a_warning():
    batch = make_batch([250, 240, 230], width=256)
    with pytest.warns(RuntimeWarning, match="too few samples"):
        shards, _ = batch.shard_by_batch_size(
            2, allow_uneven_shards=True, dynamic_batching_args=DYNAMIC
        )
    assert [len(s.micro_batch_indices[0]) for s in shards] == [2, 2]
    assert [mb.size for mb in shards[1].make_microbatch_iterator_with_dynamic_shapes()] == [1, 0]


def test_dynamic_sharding_is_deterministic_and_survives_pickle():
    batch = make_batch(random_lengths(32, 200, seed=4), width=200)
    first, restore = batch.shard_by_batch_size(2, batch_size=16, dynamic_batching_args=DYNAMIC)
    again, restore_again = batch.shard_by_batch_size(
        2, batch_size=16, dynamic_batching_args=DYNAMIC
    )
    assert restore == restore_again
    for a, b in zip(first, again, strict=True):
        assert_same(a, b)
        assert a.micro_batch_indices == b.micro_batch_indices
        assert a.micro_batch_lengths == b.micro_batch_lengths
        copy = pickle.loads(pickle.dumps(a))
        assert type(copy) is BatchedDataDict
        assert_same(copy, a)
        assert copy.micro_batch_indices == a.micro_batch_indices
        assert copy.micro_batch_lengths == a.micro_batch_lengths
        assert (copy.micro_batch_kind, copy.micro_batch_input_key) == ("dynamic", "input_ids")
        assert [m.size for m in copy.make_microbatch_iterator_with_dynamic_shapes()] == [
            m.size for m in a.make_microbatch_iterator_with_dynamic_shapes()
        ]


def test_planned_iterators_need_the_matching_plan():
    batch = make_batch([5, 3])
    with pytest.raises(ValueError, match=r"no dynamic micro-batch plan.*dynamic_batching_args"):
        batch.make_microbatch_iterator_with_dynamic_shapes()
    shards, _ = batch.shard_by_batch_size(1, dynamic_batching_args=DYNAMIC)
    with pytest.raises(ValueError, match=r"no packed micro-batch plan.*sequence_packing_args"):
        shards[0].make_microbatch_iterator_for_packable_sequences()
    shards[0].reorder_data([1, 0])  # moving rows invalidates the plan
    with pytest.raises(ValueError, match="no dynamic micro-batch plan"):
        shards[0].make_microbatch_iterator_with_dynamic_shapes()


def test_micro_batching_checks_its_inputs():
    batch = make_batch([5, 3])
    with pytest.raises(ValueError, match="'sample_id' must be a \\[batch, sequence"):
        batch.shard_by_batch_size(1, dynamic_batching_args={**DYNAMIC, "input_key": "sample_id"})
    with pytest.raises(KeyError, match="no lengths under 'lens'"):
        batch.shard_by_batch_size(1, dynamic_batching_args={**DYNAMIC, "input_lengths_key": "lens"})
    batch["input_lengths"] = torch.tensor([5, 9])
    with pytest.raises(ValueError, match="length of 9 but 'input_ids' is only 5 wide"):
        batch.shard_by_batch_size(1, dynamic_batching_args=DYNAMIC)


# ---- sequence packing ----------------------------------------------------------------------


def run_packed_model(shard: BatchedDataDict) -> list[BatchedDataDict]:
    """What a model worker does: pack each bin into one row, run, unpack per-token outputs."""
    outputs = []
    for mb in shard.make_microbatch_iterator_for_packable_sequences():
        packed = pack_sequences(mb["input_ids"], mb["input_lengths"], pad_multiple=4)
        per_token = packed.input_ids.to(torch.float64) * 0.5 + packed.position_ids
        logp = unpack_sequences(
            per_token, packed.cu_seqlens, mb["input_lengths"], mb["input_ids"].shape[1]
        )
        outputs.append(BatchedDataDict(logp=logp, sample_id=mb["sample_id"]))
    return outputs


@pytest.mark.parametrize("algorithm", ["first_fit_decreasing", "modified_first_fit_decreasing"])
@pytest.mark.parametrize("batch_size", [None, 20])
def test_packed_shards_restore_the_original_order(algorithm, batch_size):
    batch = make_batch(random_lengths(60, 300, seed=5), width=300)
    shards, restore = batch.shard_by_batch_size(
        4, batch_size=batch_size, sequence_packing_args={**PACKING, "algorithm": algorithm}
    )
    check_restores_original_order(batch, shards, restore, [run_packed_model(s) for s in shards])


def test_packed_bins_fit_the_capacity_and_match_across_shards():
    batch = make_batch(random_lengths(120, 300, seed=6), width=300)
    shards, _ = batch.shard_by_batch_size(4, batch_size=40, sequence_packing_args=PACKING)
    for g in range(3):
        assert len({len(s.micro_batch_indices[g]) for s in shards}) == 1
    for shard in shards:
        for mb in shard.make_microbatch_iterator_for_packable_sequences():
            lengths = mb["input_lengths"]
            assert mb["input_ids"].shape[1] == int(lengths.max())
            packed = pack_sequences(mb["input_ids"], lengths, pad_multiple=4)
            assert packed.input_ids.shape[1] <= 256 or mb.size == 1
            assert int((-(-lengths // 4) * 4).sum()) == packed.input_ids.shape[1]


def test_packing_gives_an_oversize_sample_its_own_bin():
    batch = make_batch([290, 30, 40, 20], width=300)
    shards, _ = batch.shard_by_batch_size(2, sequence_packing_args=PACKING)
    bins = [
        mb["sample_id"]
        for s in shards
        for mb in s.make_microbatch_iterator_for_packable_sequences()
    ]
    assert sorted(bins) == [[0], [2, 1, 3]]


def test_packing_is_deterministic_and_survives_pickle():
    batch = make_batch(random_lengths(40, 300, seed=7), width=300)
    first, restore = batch.shard_by_batch_size(2, sequence_packing_args=PACKING)
    again, restore_again = batch.shard_by_batch_size(2, sequence_packing_args=PACKING)
    assert restore == restore_again
    for a, b in zip(first, again, strict=True):
        assert a.micro_batch_indices == b.micro_batch_indices
        copy = pickle.loads(pickle.dumps(a))
        assert_same(copy, a)
        assert copy.micro_batch_kind == "packed"
        assert copy.micro_batch_indices == a.micro_batch_indices
        assert copy.micro_batch_lengths == a.micro_batch_lengths


def test_unknown_packing_algorithm_is_rejected():
    with pytest.raises(ValueError, match="unknown packing algorithm 'best'"):
        make_batch([3, 4]).shard_by_batch_size(
            1, sequence_packing_args={**PACKING, "algorithm": "best"}
        )
