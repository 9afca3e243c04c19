"""Weight export in buckets: planning, packing, and both backends' HF-named full tensors."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_models.megatron.convert import GPTLayout, hf_to_megatron, shard_megatron
from rl_models.megatron.weight_export import MegatronWeightExporter
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.weight_transfer.buckets import (
    TensorSpec,
    pack_bucket,
    pack_planned,
    plan_buckets,
    unpack_bucket,
)

from .conftest import TINY_LLAMA, tiny_config


def exported(worker_or_exporters, bucket_bytes, dtype=None):
    """{name: tensor} from running the export protocol; also the buckets' sizes."""
    out, sizes = {}, []
    for exporter in worker_or_exporters:
        plan = exporter.plan(bucket_bytes, dtype)
        for step in range(plan.steps):
            bucket = exporter.bucket(step)
            if bucket is None:
                continue
            sizes.append((bucket.nbytes, len(bucket.slots)))
            for name, t in unpack_bucket(bucket):
                assert name not in out, f"{name} exported twice"
                out[name] = t.clone()
        exporter.finish()
    return out, sizes


def test_plan_keeps_buckets_under_the_limit_and_big_tensors_alone():
    specs = [TensorSpec(f"t{i}", "float32", (n,)) for i, n in enumerate([10, 20, 300, 5, 5, 1])]
    plan = plan_buckets(specs, bucket_bytes=128)
    assert [[s.name for s in b] for b in plan] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    # 10 floats = 40 bytes, 20 floats = 80: 120 <= 128; t2 (1200 bytes) goes alone.
    bucket = pack_planned(plan[0], (torch.arange(10.0), torch.arange(20.0)))
    assert bucket.nbytes == 120
    with pytest.raises(ValueError, match="planned as float32"):
        pack_planned(plan[0], (torch.arange(10.0).double(), torch.arange(20.0)))


def test_pack_unpack_round_trip_keeps_dtype_shape_and_values():
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.float64),
        "b": torch.arange(7, dtype=torch.int32),
        "c": torch.randn(2, 2).to(torch.bfloat16),
        "d": torch.tensor(3.5),
    }
    back = dict(unpack_bucket(pack_bucket(tensors.items())))
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_zero_size_tensors_round_trip_alone_or_with_others():
    empty = torch.empty(0, 3, dtype=torch.bfloat16)
    for named in ([("e", empty)], [("a", torch.arange(3.0)), ("e", empty)]):
        back = dict(unpack_bucket(pack_bucket(named)))
        for name, t in named:
            assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_dtensor_export_equals_the_state_dict_in_small_buckets():
    worker = DTensorPolicyWorker(tiny_config())
    state = worker.model.state_dict()
    got, sizes = exported([worker._weight_exporter()], bucket_bytes=40_000)
    assert len(sizes) > 3
    assert all(nbytes <= 40_000 or count == 1 for nbytes, count in sizes)  # embedding: 64 kB
    assert set(got) == set(state)
    for name, t in state.items():
        assert torch.equal(got[name], t), name
    as_bf16, _ = exported([worker._weight_exporter()], 1 << 20, dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in as_bf16.values())


def test_tied_weights_are_exported_once():
    config = tiny_config(model={"hf_config": {**TINY_LLAMA, "tie_word_embeddings": True}})
    worker = DTensorPolicyWorker(config)
    got, _ = exported([worker._weight_exporter()], 1 << 20)
    assert "lm_head.weight" not in got
    assert torch.equal(got["model.embed_tokens.weight"], worker.model.lm_head.weight)


def test_lora_export_is_the_merged_model():
    config = tiny_config(lora={"enabled": True, "rank": 4, "alpha": 8.0})
    worker = DTensorPolicyWorker(config)
    with torch.no_grad():  # non-zero adapters, so the merge matters
        for name, p in worker.model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    got, _ = exported([worker._weight_exporter()], 30_000)
    base = worker.model.get_base_model()
    reference = AutoModelForCausalLM.from_config(base.config, dtype=torch.float64)
    assert set(got) == set(reference.state_dict())
    x = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 9))
    reference.load_state_dict(got)
    with torch.no_grad():  # the merged plain model computes what the adapted model does
        torch.testing.assert_close(reference(x).logits, worker.model(input_ids=x).logits)


class _Shard:
    """One simulated Megatron rank: its piece of the model, as ``state_dict`` returns it."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("tied", [False, True])
def test_megatron_export_of_tp_pp_shards_equals_the_hf_state_dict(tp, pp, tied):
    """Every rank of a simulated tp x pp grid runs the exporter in turn; the tensor-parallel
    gather is simulated by handing the destination the peers' parts of the same tensor."""
    torch.manual_seed(0)
    hf = dict(TINY_LLAMA, tie_word_embeddings=tied, vocab_size=127)  # 127: TP pads the vocab
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    layout = GPTLayout.from_hf_config(config)
    full = hf_to_megatron(model.state_dict(), layout)
    grid = [
        [shard_megatron(full, layout, tp=tp, tp_rank=t, pp=pp, pp_rank=p) for t in range(tp)]
        for p in range(pp)
    ]

    def gather_for(p, t):
        def gather(tensor):
            # By value: weights are random (the all-ones norms are equal on every rank too).
            name = next(
                n for n, v in grid[p][t].items() if v.shape == tensor.shape and v.equal(tensor)
            )
            return [grid[p][r][name] for r in range(tp)] if t == 0 else None

        return gather

    exporters = [
        MegatronWeightExporter(
            _Shard(grid[p][t]),
            layout,
            tp=tp,
            tp_rank=t,
            pp=pp,
            pp_rank=p,
            dp_rank=0,
            gather=gather_for(p, t),
        )
        for p in range(pp)
        for t in range(tp)
    ]
    layer_bytes = sum(v.numel() * 8 for k, v in model.state_dict().items() if ".layers.0." in k)
    got, sizes = exported(exporters, bucket_bytes=layer_bytes // 3)
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    # Nobody held more than one layer's (or the embedding's) converted tensors at once.
    embed = model.model.embed_tokens.weight.numel() * 8
    assert max(e.peak_held_bytes for e in exporters) <= max(layer_bytes, embed)
    assert all(nbytes <= layer_bytes // 3 or count == 1 for nbytes, count in sizes)
    assert sum(nbytes for nbytes, _ in sizes) == sum(t.numel() * 8 for t in expected.values())
