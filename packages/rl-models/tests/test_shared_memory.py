"""The shared-memory refit channel in one process: region files, layouts, and both sides.

A region is a file mapped ``MAP_SHARED``; what one mapping writes every other mapping (in any
process) reads. The Ray end-to-end runs (2-rank policy, train step, refit, exact weights) are in
``test_refit.py``; the 2-rank FSDP2 row-slice writes in ``test_two_ranks.py``.
"""

import os
import signal
import subprocess
import sys
import types

import pytest
import torch

from rl_models.generation.config import GenerationConfig
from rl_models.generation.hf_worker import HfGenerationWorker
from rl_models.generation.interfaces import IncompleteRefitError, StaleWeightsError
from rl_models.generation.refit import (
    SharedWeightRegion,
    _one_node,
    pick_channel,
    weight_sync,
)
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.weight_transfer.buckets import TensorSpec, unpack_bucket
from rl_models.weight_transfer.shared_memory import (
    PREFIX,
    MappedRegion,
    RegionLayout,
    _start_time,
    create_region,
    map_region,
    remove_stale_regions,
)

from .conftest import TINY_LLAMA, tiny_config

SPECS = [
    TensorSpec("a", "float32", (3, 5)),
    TensorSpec("b", "bfloat16", (7,)),
    TensorSpec("c", "int64", (0, 4)),
    TensorSpec("d", "float64", (2, 2)),
]


def test_layout_aligns_every_tensor_and_its_digest_tells_layouts_apart():
    layout = RegionLayout.of(SPECS)
    assert [s.offset % 8 for s in layout.slots] == [0] * 4
    assert layout.nbytes == 64 + 16 + 0 + 32
    changed = RegionLayout.of([*SPECS[:3], TensorSpec("d", "float64", (4,))])
    assert layout.digest == RegionLayout.of(list(SPECS)).digest != changed.digest


def test_a_region_write_is_seen_by_another_process(tmp_path):
    layout = RegionLayout.of(SPECS)
    path = create_region(layout.nbytes, str(tmp_path))
    region = MappedRegion(path, layout)
    writer = (
        "import sys, torch\n"
        "t = torch.from_file(sys.argv[1], shared=True, size=64, dtype=torch.uint8)\n"
        "t.view(torch.float32).copy_(torch.arange(16.0))\n"
    )
    subprocess.run([sys.executable, "-c", writer, path], check=True)
    assert torch.equal(region.views["a"], torch.arange(15.0).reshape(3, 5))
    with pytest.raises(ValueError, match="holds 112 bytes; the layout needs 1000"):
        map_region(path, 1000)


def test_region_files_of_dead_creators_are_swept(tmp_path):
    """A creator is a pid *and* its start time: a file of a pid now used by another process
    (here: ours, with another start time) is stale too."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = os.getpid()
    stale = tmp_path / f"{PREFIX}{dead.pid}-123-abc"
    reused_pid = tmp_path / f"{PREFIX}{me}-1-abc"
    alive = tmp_path / f"{PREFIX}{me}-{_start_time(me)}-def"
    other = tmp_path / "unrelated-1"
    for f in (stale, reused_pid, alive, other):
        f.write_bytes(b"x")
    path = create_region(16, str(tmp_path))
    assert not stale.exists() and not reused_pid.exists()
    assert alive.exists() and other.exists()
    assert os.path.basename(path).startswith(f"{PREFIX}{me}-{_start_time(me)}-")
    assert remove_stale_regions(str(tmp_path)) == []


def test_a_creator_killed_while_its_region_is_named_leaves_it_to_the_next_creation(tmp_path):
    """The one window in which a region has a name (its set-up): a creator SIGKILLed there
    leaves the file, and the next region created on the machine removes it."""
    script = (
        "import sys, time\n"
        "from rl_models.weight_transfer.shared_memory import create_region\n"
        "print(create_region(1 << 16, sys.argv[1]), flush=True)\n"
        "time.sleep(600)\n"
    )
    creator = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        path = creator.stdout.readline().strip()
        assert os.path.exists(path)
    finally:
        creator.kill()
        creator.wait()
    assert creator.returncode == -signal.SIGKILL
    assert os.path.exists(path)  # nothing ran in the creator after the kill
    create_region(16, str(tmp_path))
    assert not os.path.exists(path)


class Fake:
    """A stand-in object with the given attributes (unlike SimpleNamespace, weakly referable:
    a ``WeightSync`` holds its policy and the policy's group by weak references)."""

    def __init__(self, **attributes) -> None:
        self.__dict__.update(attributes)


def test_a_weight_sync_serves_only_the_policy_it_was_made_for_even_at_a_reused_id():
    """The generator keeps its ``WeightSync`` (and so its region) for the policy it was made
    with, whose ranks map the region. A new policy at the address, so the ``id()``, of a
    collected one never mapped it: it must get a sync of its own, and the old one is released."""

    def policy():
        return Fake(worker_group=Fake(workers=()))

    made_for, generation = policy(), Fake()
    sync = weight_sync(made_for, generation)
    assert generation.weight_sync is sync and weight_sync(made_for, generation) is sync
    sync.region = SharedWeightRegion(None, "/dev/shm/unused", RegionLayout.of(SPECS))
    assert sync.serves(made_for) and not sync.serves(policy())
    del made_for
    with pytest.raises(RuntimeError, match="garbage-collected"):
        sync.policy  # noqa: B018
    # CPython usually hands a freed object's memory, so its id(), to the next object of its
    # size; whether it does here is up to the allocator, so no new policy may be served, and
    # the new ones are kept alive so that each one takes a different address.
    new_policies = [policy() for _ in range(1_000)]
    assert not any(sync.serves(p) for p in new_policies)
    replaced = weight_sync(new_policies[0], generation)
    assert replaced is not sync and generation.weight_sync is replaced
    assert sync.region is None  # released: the policy is gone, nothing to call, nothing kept


def exporter_layout(worker) -> RegionLayout:
    plan = worker.weight_export_plan(bucket_bytes=1 << 20)
    worker.finish_weight_export()
    return RegionLayout.of([s for bucket in plan.buckets for s in bucket])


def test_a_policy_writes_its_exact_weights_into_the_region(tmp_path):
    """Tied weights once; a LoRA model writes the merged weights, as the bucket export does."""
    for config in (
        tiny_config(model={"hf_config": {**TINY_LLAMA, "tie_word_embeddings": True}}),
        tiny_config(lora={"enabled": True, "rank": 4, "alpha": 8.0}),
    ):
        worker = DTensorPolicyWorker(config)
        with torch.no_grad():  # non-zero adapters, so the merge matters
            for name, p in worker.model.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        layout = exporter_layout(worker)
        path = create_region(layout.nbytes, str(tmp_path))
        stats = worker.write_weights_to_region(path, layout, bucket_bytes=1 << 20)
        assert stats["bytes_written"] == sum(s.nbytes for s in layout.slots)
        written = MappedRegion(path, layout).views
        exporter = worker._weight_exporter()  # the bucket export: the reference
        expected = {}
        for step in range(exporter.plan(1 << 20).steps):
            expected.update(unpack_bucket(exporter.bucket(step)))
        assert set(written) == set(expected)
        for name, t in expected.items():
            assert torch.equal(written[name], t), name


def test_a_write_walks_the_model_state_once(tmp_path, monkeypatch):
    """The write looks the model's state dict up a fixed number of times, not once per tensor
    (on one rank every tensor takes the gathered path; a state_dict walk costs ~0.5 ms, which
    for a 100M model was most of a refit)."""
    from rl_models.policy.weight_export import DTensorWeightExporter

    worker = DTensorPolicyWorker(tiny_config(lora={"enabled": True, "rank": 4, "alpha": 8.0}))
    layout = exporter_layout(worker)
    assert len(layout.slots) > 10
    path = create_region(layout.nbytes, str(tmp_path))
    walks = []
    live = DTensorWeightExporter._live
    monkeypatch.setattr(DTensorWeightExporter, "_live", lambda self: walks.append(1) or live(self))
    worker.write_weights_to_region(path, layout, bucket_bytes=1 << 20)
    assert 1 <= len(walks) <= 2, f"{len(walks)} state-dict walks for {len(layout.slots)} tensors"


def generation_worker(config) -> HfGenerationWorker:
    gen_config = GenerationConfig(
        backend="hf", sampling={"max_new_tokens": 3, "stop_token_ids": []}
    )
    return HfGenerationWorker(gen_config.model_dump(), config.model.model_dump())


PROMPTS = {"input_ids": torch.tensor([[5, 9, 2], [7, 1, 0]]), "input_lengths": torch.tensor([3, 2])}


def test_generator_parameters_become_views_of_the_region_and_refits_need_no_load(tmp_path):
    from rl_distributed.batched_data_dict import BatchedDataDict

    config = tiny_config(model={"hf_config": TINY_LLAMA, "dtype": "float32"})
    policy = DTensorPolicyWorker(config)
    gen = generation_worker(config)
    prompts = BatchedDataDict(**PROMPTS)
    before = {n: p.detach().clone() for n, p in gen.model.named_parameters()}
    layout = exporter_layout(policy)
    gen.prepare_for_weight_update()
    path, reason = gen.map_weight_region(None, layout)
    assert reason is None and path.startswith("/dev/shm/" + PREFIX)
    try:
        start = gen.region.tensor.data_ptr()  # the worker's own mapping of the file
        end = start + layout.nbytes
        for name, p in gen.model.named_parameters():
            assert start <= p.data_ptr() < end, name  # the region is the model's memory
            assert torch.equal(p, before[name]), name  # and holds its weights so far
        with pytest.raises(IncompleteRefitError):  # parameters in shared memory: not stamped
            gen.generate(prompts, greedy=True)

        # Both sides map the region; then its name goes (what refit does): nothing is left in
        # /dev/shm, whichever process is killed, and the mappings still share the memory.
        policy.map_weight_region(path, layout)
        gen.unlink_weight_region(path)
        assert not os.path.exists(path)
        with torch.no_grad():  # the policy moves on and writes into the region: that is all
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        policy.write_weights_to_region(path, layout, bucket_bytes=1 << 20)
        with pytest.raises(RuntimeError, match="this worker maps"):
            gen.commit_weight_region(path, "0" * 16, 1)
        gen.commit_weight_region(path, layout.digest, 1)
        for name, p in policy.model.named_parameters():
            assert torch.equal(gen.params[name], p), name
        out = gen.generate(prompts, greedy=True, expected_weight_version=1)
        with pytest.raises(StaleWeightsError):
            gen.generate(prompts, greedy=True, expected_weight_version=2)

        # A refit that stops after the generator was told to expect one refuses to sample.
        gen.prepare_for_weight_update()
        with pytest.raises(IncompleteRefitError, match="mix of version 1"):
            gen.generate(prompts, greedy=True, expected_weight_version=1)
        policy.write_weights_to_region(path, layout, bucket_bytes=1 << 20)
        gen.commit_weight_region(path, layout.digest, 2)
        again = gen.generate(prompts, greedy=True, expected_weight_version=2)
        assert torch.equal(again["output_ids"], out["output_ids"])
        # A rank that no longer (or never) mapped the nameless region cannot reach it: it says so.
        policy.release_weight_region(path)
        with pytest.raises(FileNotFoundError, match="not mapped by this policy rank"):
            policy.write_weights_to_region(path, layout, bucket_bytes=1 << 20)
    finally:
        gen.shutdown()
    assert not os.path.exists(path)


def test_a_generator_that_cannot_share_says_why_and_changes_nothing():
    config = tiny_config(model={"hf_config": TINY_LLAMA, "dtype": "float32"})
    gen = generation_worker(config)
    policy = DTensorPolicyWorker(tiny_config(model={"hf_config": TINY_LLAMA, "dtype": "float64"}))
    path, reason = gen.map_weight_region(None, exporter_layout(policy))
    assert path is None and "as float64" in reason and "model's is float32" in reason
    assert gen.region is None and not gen.updating


def test_no_room_in_shared_memory_is_a_fallback_not_a_crash(monkeypatch):
    """A /dev/shm smaller than the model (Docker's default is 64 MiB): the region's pages are
    reserved up front, so the failure is ENOSPC at creation and the generator keeps its own
    weights, instead of SIGBUS in whichever process writes first."""
    import errno

    from rl_models.weight_transfer import shared_memory

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_memory.os, "posix_fallocate", no_space)
    config = tiny_config(model={"hf_config": TINY_LLAMA, "dtype": "float32"})
    gen = generation_worker(config)
    before = {n: p.detach().clone() for n, p in gen.model.named_parameters()}
    layout = exporter_layout(DTensorPolicyWorker(config))
    leftovers = set(os.listdir("/dev/shm"))
    path, reason = gen.map_weight_region(None, layout)
    assert path is None and "No space left" in reason
    assert gen.region is None and not gen.updating
    assert set(os.listdir("/dev/shm")) == leftovers  # the half-made file was removed
    for name, p in gen.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_auto_picks_shared_memory_only_on_one_cpu_node():
    assert pick_channel("auto", colocated=False, use_gpus=False, one_node_shared=True) == (
        "shared_memory"
    )
    assert pick_channel("auto", colocated=True, use_gpus=False) == "object_store"
    assert pick_channel("auto", colocated=True, use_gpus=True, one_node_shared=True) == "cuda_ipc"

    def group(*nodes):
        meta = [types.SimpleNamespace(placement={"node_id": n}) for n in nodes]
        return types.SimpleNamespace(worker_metadata=meta)

    assert _one_node(group("n1", "n1"), group("n1"))
    assert not _one_node(group("n1", "n1"), group("n2"))
    assert not _one_node(group("n1"), group(None))  # not started: unknown


def test_megatron_stages_write_their_gathered_layers_into_one_region(tmp_path):
    """A simulated tp=2 x pp=2 Megatron grid: each stage's tensor-parallel rank 0 writes its
    layers (gathered and converted to HF) into the slots of one region laid out over both
    stages' plans, as ``refit`` lays it out; the region equals the HF state dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_models.megatron.convert import GPTLayout, hf_to_megatron, shard_megatron
    from rl_models.megatron.weight_export import MegatronWeightExporter
    from rl_models.policy.weight_export import WeightExportMethods

    from .test_weight_export import _Shard

    tp, pp = 2, 2
    torch.manual_seed(0)
    hf = dict(TINY_LLAMA, vocab_size=127)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    mlayout = GPTLayout.from_hf_config(config)
    full = hf_to_megatron(model.state_dict(), mlayout)
    grid = [
        [shard_megatron(full, mlayout, tp=tp, tp_rank=t, pp=pp, pp_rank=p) for t in range(tp)]
        for p in range(pp)
    ]

    def gather_for(p, t):
        def gather(tensor):
            name = next(n for n, v in grid[p][t].items() if v.equal(tensor))
            return [grid[p][r][name] for r in range(tp)] if t == 0 else None

        return gather

    class Rank(WeightExportMethods):
        def __init__(self, p, t):
            self.exporter = MegatronWeightExporter(
                _Shard(grid[p][t]), mlayout, tp=tp, tp_rank=t, pp=pp, pp_rank=p, dp_rank=0,
                gather=gather_for(p, t),
            )  # fmt: skip

        def _weight_exporter(self):
            return self.exporter

    ranks = [Rank(p, t) for p in range(pp) for t in range(tp)]
    plans = [r.weight_export_plan(bucket_bytes=1 << 14) for r in ranks]
    for r in ranks:
        r.finish_weight_export()
    layout = RegionLayout.of([s for p in plans for bucket in p.buckets for s in bucket])
    path = create_region(layout.nbytes, str(tmp_path))
    written = [r.write_weights_to_region(path, layout, bucket_bytes=1 << 14) for r in ranks]
    assert [w["bytes_written"] > 0 for w in written] == [True, False, True, False]
    region = MappedRegion(path, layout).views
    expected = model.state_dict()
    assert set(region) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(region[name], tensor), name


def test_shared_memory_asked_for_where_it_cannot_work_is_refused_before_any_call():
    """vLLM (which repacks its weights) or workers on two nodes: a clear error, and not one
    worker is called (the fake groups have no workers to call)."""
    from rl_models.generation.refit import refit

    def group(*nodes):
        meta = [types.SimpleNamespace(placement={"node_id": n}) for n in nodes]
        cluster = types.SimpleNamespace(use_gpus=False)
        return Fake(worker_metadata=meta, cluster=cluster)

    config = GenerationConfig(backend="hf", colocated=False)
    policy = Fake(worker_group=group("node-a", "node-a"), weight_version=1, config=tiny_config())
    vllm_like = types.SimpleNamespace(config=config, worker_group=group("node-a"))
    with pytest.raises(ValueError, match=r"vLLM-cpu repacks its weights.*SimpleNamespace"):
        refit(policy, vllm_like, channel="shared_memory")
    elsewhere = types.SimpleNamespace(
        config=config, worker_group=group("node-b"), shares_weight_memory=True
    )
    with pytest.raises(ValueError, match=r"on nodes \['node-a', 'node-b'\]"):
        refit(policy, elsewhere, channel="shared_memory")
