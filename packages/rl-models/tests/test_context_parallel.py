"""Context parallelism of the DTensor backend: what one process can check (the config's
refusals, the workers' layout, the split of rows and its attention mask, simulated rank by
rank). Two cp ranks computing against one process are in ``test_two_ranks.py`` (the
``context_parallel`` scenario)."""

import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing import start_processes
from transformers import AutoConfig, AutoModelForCausalLM

from rl_models.policy.context_parallel import ContextGroup, split_indices
from rl_models.policy.context_parallel_rules import check_model
from rl_models.policy.forward import ForwardOptions
from rl_models.policy.lm_policy import worker_sharding
from rl_models.weight_transfer.channels import free_port

from .conftest import TINY_LLAMA, tiny_config


def test_context_parallel_lays_the_workers_out_as_dp_by_cp():
    config = tiny_config(dtensor={"context_parallel_size": 2})
    assert (config.context_parallel_size, config.model_parallel_size) == (2, 2)
    sharding = worker_sharding(config, 4)
    assert sharding.get_axis_size("data_parallel") == 2
    assert sharding.get_axis_size("context_parallel") == 2
    # Consecutive ranks share a dp rank: the worker's ("dp", "cp") mesh numbers them alike.
    assert sharding.get_worker_coords(1)["context_parallel"] == 1
    assert sharding.get_worker_coords(2)["data_parallel"] == 1
    with pytest.raises(ValueError, match="context_parallel_size 2"):
        worker_sharding(config, 3)


def test_context_with_tensor_parallelism_lays_the_workers_out_as_dp_by_cp_by_tp():
    config = tiny_config(
        dtensor={"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}
    )
    assert config.model_parallel_size == 4
    sharding = worker_sharding(config, 8)
    assert sharding.get_axis_size("data_parallel") == 2
    # tp fastest, then cp, then dp: the worker's ("dp", "cp", "tp") mesh numbers them alike.
    axes = ("data_parallel", "context_parallel", "tensor_parallel")
    for rank, coords in ((1, (0, 0, 1)), (2, (0, 1, 0)), (4, (1, 0, 0)), (7, (1, 1, 1))):
        assert tuple(sharding.get_worker_coords(rank)[a] for a in axes) == coords
    with pytest.raises(ValueError, match="context_parallel_size 2"):
        worker_sharding(config, 6)


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"activation_checkpointing": True}, "activation_checkpointing"),
        ({"lora": {"enabled": True}}, "lora.enabled"),
        ({"model": {"hf_config": TINY_LLAMA, "kind": "value"}}, "model.kind=value"),
        ({"router_replay": True}, "router_replay"),
        (
            {"model": {"hf_config": TINY_LLAMA, "attn_implementation": "eager"}},
            "model.attn_implementation=eager (use sdpa)",
        ),
    ],
)
def test_combinations_context_parallelism_cannot_run_are_refused(overrides, named):
    config = {**overrides, "dtensor": {"context_parallel_size": 2, **overrides.get("dtensor", {})}}
    with pytest.raises(ValueError, match=r"context_parallel_size=2 does not work with .*"):
        tiny_config(**config)
    with pytest.raises(ValueError, match=re.escape(named)):
        tiny_config(**config)


def test_the_shared_prompt_pass_is_off_under_context_parallelism():
    on = tiny_config(share_prompt_prefix=True)
    assert ForwardOptions.of(on).share_prefix
    cp = tiny_config(share_prompt_prefix=True, dtensor={"context_parallel_size": 2})
    assert not ForwardOptions.of(cp).share_prefix


@pytest.mark.parametrize("width, cp", [(12, 2), (10, 2), (146, 2), (29, 3), (64, 4)])
def test_every_position_is_held_once_and_ranks_get_equal_causal_pair_counts(width, cp):
    held = [split_indices(width, cp, r) for r in range(cp)]
    padded = -(-width // (2 * cp)) * 2 * cp
    assert torch.equal(torch.cat(held).sort().values, torch.arange(padded))
    assert len({len(h) for h in held}) == 1
    # In one causal document a query at position t sees t + 1 keys: each rank's count of
    # unmasked query-key pairs is the same (what a block-skipping kernel's work would follow).
    pairs = {int((h + 1).sum()) for h in held}
    assert len(pairs) == 1, pairs
    assert torch.equal(split_indices(12, 2, 0), torch.tensor([0, 1, 2, 9, 10, 11]))


def packed_row(lengths=(5, 11, 3)) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A packed row of documents (positions restarting at 0), its documents and its tokens."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    return {"input_ids": ids, "position_ids": positions, "use_cache": False}, documents, ids


def splits(inputs: dict, documents: torch.Tensor, cp: int) -> list:
    # No collective is called while splitting: a group-less ContextGroup per rank.
    return [ContextGroup(None, cp, r).split(inputs, documents) for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 3])
def test_split_and_gather_order_round_trips_with_global_positions_and_targets(cp):
    inputs, documents, ids = packed_row()
    parts = splits(inputs, documents, cp)
    width = ids.shape[1]
    for part in parts:
        # Positions are the row's (restarting per document), not the rank's own count.
        assert torch.equal(part.inputs["position_ids"], part.local(inputs["position_ids"]))
        assert part.inputs["attention_mask"] is None
    # What the all-gather concatenates, put back in the row's order: the row again.
    gathered = torch.cat([p.inputs["input_ids"] for p in parts], 1)
    assert torch.equal(gathered.index_select(1, parts[0].restore)[:, :width], ids)
    # Targets shifted on the whole row before the split: a chunk's last token has its
    # target even where the next token is held by another rank.
    targets = F.pad(ids[:, 1:], (0, 1))
    for part in parts:
        local = part.local(targets)[0]
        for j, t in enumerate(part.index.tolist()):
            want = int(ids[0, t + 1]) if t + 1 < width else 0
            assert int(local[j]) == want
    # (Such tokens exist: rank 0's first chunk ends where rank 1's begins.)
    assert int(parts[0].index[len(parts[0].index) // 2 - 1]) + 1 in parts[1].index.tolist()


@pytest.mark.parametrize("cp", [2, 3])
def test_rank_by_rank_attention_over_gathered_keys_equals_per_document_attention(cp):
    """What the kernel computes on each rank (its queries against every rank's keys, in
    gather order, under the split's attention bias), put back in order, equals causal attention run on
    each document alone; the padding queries see something (no NaN)."""
    lengths = (5, 11, 3)
    inputs, documents, _ = packed_row(lengths)
    width, heads, dim = sum(lengths), 2, 8
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, heads, width, dim, generator=gen, dtype=torch.float64) for _ in "qkv")
    parts = splits(inputs, documents, cp)

    def local(t, part):  # [1, H, S, D] -> this rank's tokens
        return part.local(t.transpose(1, 2)).transpose(1, 2)

    keys = torch.cat([local(k, p) for p in parts], 2)
    values = torch.cat([local(v, p) for p in parts], 2)
    # The kernel's mask: the split's additive float bias, built once for every layer.
    biases = [p.attention_bias(torch.float64) for p in parts]
    assert all(p.attention_bias(torch.float64) is b for p, b in zip(parts, biases, strict=True))
    outs = [
        F.scaled_dot_product_attention(local(q, p), keys, values, b)
        for p, b in zip(parts, biases, strict=True)
    ]
    got = torch.cat(outs, 2).index_select(2, parts[0].restore)
    assert not got.isnan().any()
    expected = []
    for s, n in zip([0, 5, 16], lengths, strict=True):
        piece = (t[:, :, s : s + n] for t in (q, k, v))
        expected.append(F.scaled_dot_product_attention(*piece, is_causal=True))
    torch.testing.assert_close(got[:, :, :width], torch.cat(expected, 2), rtol=0, atol=1e-12)


def test_padded_rows_attend_within_their_real_tokens():
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    documents = torch.tensor([[0, 0, 0, -1, -1], [0, 0, 0, 0, 0]])
    inputs = {"input_ids": ids, "attention_mask": (documents >= 0).long()}
    part = ContextGroup(None, 2, 0).split(inputs, documents)
    # Positions count from each row's start; rank 0 holds positions 0, 1 and 6, 7 (padding).
    assert torch.equal(part.inputs["position_ids"], torch.tensor([[0, 1, 0, 0]] * 2))
    order = torch.cat([split_indices(5, 2, r) for r in range(2)])
    row0 = part.mask[0, 0]  # query 1 of row 0 sees keys 0 and 1; padding sees padding only
    assert order[row0[1]].tolist() == [0, 1]
    assert sorted(order[row0[2]].tolist()) == [3, 4, 5, 6]
    assert sorted(order[part.mask[1, 0, 1]].tolist()) == [0, 1]


def test_gather_on_a_cp_group_without_global_rank_0_against_float64_math():
    """Four gloo processes as dp=2 x cp=2: the gather's forward and both backwards (summed
    for keys and values, own slice for outputs) on each cp group, the second of which does
    not hold global rank 0 (where torch's autograd all-gather failed). Each rank checks its
    results against float64 arithmetic on the tensors every rank can make for itself; the
    ranks are forked (no re-import: they start in well under a second)."""
    start_processes(_gather_rank, args=(free_port(),), nprocs=4, start_method="fork")


def _tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check_gather(cp: ContextGroup, members: list[int], rank: int, dim: int, same: bool) -> None:
    """Gather along ``dim``; each rank's loss weighs the whole with its own weights (or, with
    ``same``, the group's shared ones, as every rank computing one loss does)."""
    shape = (2, 3, 2, 4)
    mine = _tensor(shape, seed=rank).requires_grad_()
    whole = cp.gather(mine, dim, same_gradient=same)
    expected = torch.cat([_tensor(shape, seed=r) for r in members], dim)
    torch.testing.assert_close(whole, expected, rtol=0, atol=0)

    def weights(r: int) -> torch.Tensor:
        return _tensor(expected.shape, seed=100 + (members[0] if same else r) + 10 * dim)

    (whole * weights(rank)).sum().backward()
    own = slice(cp.rank * shape[dim], (cp.rank + 1) * shape[dim])
    index = (slice(None),) * dim + (own,)
    # Every rank's loss reads this rank's slice: their gradients summed; or the one shared
    # loss's gradient, taken once.
    want = sum(weights(r)[index] for r in ([rank] if same else members))
    torch.testing.assert_close(mine.grad, want, rtol=0, atol=1e-15)


def _gather_rank(rank: int, port: int) -> None:
    address = f"tcp://127.0.0.1:{port}"
    timeout = timedelta(seconds=60)  # a hung collective fails the run instead of stalling it
    dist.init_process_group("gloo", address, rank=rank, world_size=4, timeout=timeout)
    try:
        groups = [[0, 1], [2, 3]]  # the cp groups of dp ranks 0 and 1
        handles = [dist.new_group(members) for members in groups]  # every rank makes each
        members = groups[rank // 2]
        cp = ContextGroup.of(handles[rank // 2])
        assert cp.rank == rank % 2 and cp.size == 2
        _check_gather(cp, members, rank, dim=2, same=False)  # keys and values
        _check_gather(cp, members, rank, dim=1, same=True)  # per-token outputs
    finally:
        dist.destroy_process_group()


SMALL = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 32,
}


def meta_model(model_type: str, **config) -> torch.nn.Module:
    """The model class and config ``check_model`` reads, with no weights allocated."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL, **config))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_full_attention_families_are_accepted(model_type):
    check_model(meta_model(model_type), 2)


@pytest.mark.parametrize(
    "model_type, config, named",
    [
        # Short convolutions beside attention: named by its layer type.
        ("lfm2", {"layer_types": ["conv", "full_attention"]}, "'lfm2' has ['conv'] layers"),
        ("minimax", {}, "'minimax' has ['linear_attention'] layers"),
        # A family not on the list, whatever its layers (no layer_types to read here).
        ("gpt2", {}, "'gpt2' is not known to have full-attention layers only"),
        # Sliding-window layers of an allowed family, named by their layer type.
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
            "'qwen2' has ['sliding_attention'] layers",
        ),
    ],
)
def test_models_with_other_sequence_layers_are_refused_by_name(model_type, config, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        check_model(meta_model(model_type, **config), 2)
