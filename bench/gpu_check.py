"""A Ray-free check of the library's CUDA code: training step, log-probs, sampling, refit, MFU.

A GPU machine may have its own torch and transformers but no package index, and no room for
Ray's and vLLM's large wheels. So this script builds the DTensor
policy worker, the Hugging Face generation worker and the weight channels directly, one process
per rank (``torch.multiprocessing``), and holds each result against an independent reference
computed in this process in float64 on the CPU (plain transformers model, ``log_softmax``,
``gather``, autograd):

1. world size 1, then 2 (NCCL when there is a GPU per rank, else gloo on the CPU): chunked
   log-probs and one bf16 training step (SGD, no clipping: the update is ``-lr * gradient``),
   with the ranks laid out three ways (``bench/gpu_check_parallel.py``): data parallel (the
   rows split over the ranks); tensor parallel (``tp`` = world size, sequence parallel; world
   2 only, since ``tp = 1`` is the data-parallel layout); context parallel (``cp`` = world
   size, the rows packed into one long row that the ranks split along the sequence).
2. the HF generation worker, on the device in this process: greedy and sampled responses have
   valid token ids and the asked-for lengths, greedy tokens are the argmax of the float64
   logits, and the reported log-probs are the float64 ones.
3. the trained weights go from policy rank 0 into the generation worker (another process) over
   the CUDA IPC channel; received must equal sent bit for bit. On a CPU the same IPC handles
   carry shared CPU storage instead of device memory (a stand-in for CUDA IPC, said so in the
   output), and the shared-memory region channel runs too.
4. MFU last (``bench/mfu.py``).

Each check prints PASS or FAIL with its numbers; the exit status is 1 if any failed.

    python bench/gpu_check.py                 # qwen2-0.5b's shape on CUDA, the tiny model on CPU
    python bench/gpu_check.py --model tiny    # what CI runs (tests/test_gpu_check.py)

``bench/gpu_check_carry.sh`` prepares the few small wheels it needs on a machine that has
torch and transformers only, and prints the command to run there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mfu
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_check_parallel import (
    LR,
    Reference,
    check_cases,
    check_rows,
    reference_model,
    run_cases,
    run_step,
)

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.config import GenerationConfig
from rl_models.generation.hf_worker import HfGenerationWorker
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.weight_transfer.channels import free_port
from rl_models.weight_transfer.shared_memory import RegionLayout

# The generation worker computes in float32; the float64 reference differs by float32 rounding.
FP32_LOGPROB_MAX = 2e-3
ARGMAX_MARGIN = 0.01  # greedy = argmax is checked where the top two logits differ by more


@dataclass(frozen=True)
class Setup:
    """What every rank and the reference need (pickled into each spawned rank)."""

    model_name: str
    hf_config: dict[str, Any]
    batch: BatchedDataDict  # the global batch, rows split evenly over the ranks
    chunk_size: int
    bucket_bytes: int
    out_dir: str

    def result_file(self, world: int, rank: int, case: str = "rows") -> str:
        return os.path.join(self.out_dir, f"world{world}-{case}-rank{rank}.pt")


def check_config(model_name: str) -> dict[str, Any]:
    """``bench/mfu.py``'s config of ``model_name``, its weights drawn at std 1/sqrt(hidden size).

    Then each matrix keeps its input's scale, so attention scores and logits are of order 1 and
    every part of the model takes a real share of the gradient. At transformers' default std of
    0.02 the small models are nearly uniform (micro's loss is within 0.02 of ln(vocab)): its
    q_proj and k_proj get ~0 % of the squared gradient norm, the MLP 2 % and the norm weights
    0.02 %, so no bound could see their tensor-parallel split go wrong. At 1/sqrt(64) micro's are
    13 %, 22 % and 1 %. For qwen2-0.5b the std is 0.033 instead of 0.02.
    """
    config = dict(mfu.MODELS[model_name])
    config["initializer_range"] = config["hidden_size"] ** -0.5
    return config


def policy_config(setup: Setup) -> dict[str, Any]:
    rows = setup.batch.size
    return {
        "model": {"hf_config": setup.hf_config, "dtype": "float32"},
        "optimizer": {"name": "SGD", "kwargs": {"lr": LR}},
        "max_grad_norm": None,
        "train_global_batch_size": rows,
        "train_micro_batch_size": 2,  # several micro-batches: gradient accumulation runs too
        "logprob_chunk_size": setup.chunk_size,
        "mixed_precision": "bfloat16",
    }


# -- the policy ranks (spawned processes) ------------------------------------------------------


def policy_rank(rank: int, world: int, setup: Setup, to_parent: Any, to_rank0: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    try:
        run_policy_rank(rank, world, setup, to_parent, to_rank0)
    except BaseException:
        to_parent.put(("error", f"policy rank {rank} of {world}:\n{traceback.format_exc()}"))
        raise


def run_policy_rank(rank: int, world: int, setup: Setup, to_parent: Any, to_rank0: Any) -> None:
    """Train one step, then send the weights; rank 0 talks to the parent, in this order:
    trained, ipc_bucket* (each acknowledged), ipc_done, [region_layout, region_written], done.
    The tensor- and context-parallel cases run before ``done``."""
    worker = DTensorPolicyWorker(policy_config(setup))
    lead = rank == 0
    rows = setup.batch.size // world
    torch.save(
        run_step(worker, setup.batch.slice(rank * rows, (rank + 1) * rows)),
        setup.result_file(world, rank),
    )
    barrier(world)
    if lead:
        to_parent.put(("trained", None))

    plan = worker.weight_export_plan(setup.bucket_bytes)
    for step in range(plan.steps):
        bucket = worker.export_weight_bucket_ipc(step)  # a collective: every rank gathers
        if plan.producer:
            if not lead:
                raise RuntimeError(f"rank {rank} produces weight buckets; only rank 0 may here")
            to_parent.put(("ipc_bucket", bucket))
            expect(to_rank0, "ack")  # the receiver copied it: the buffer may be reused
    stats = worker.finish_weight_export()
    if lead:
        to_parent.put(("ipc_done", stats))

    if worker.device.type == "cpu":
        # The shared-memory channel: one region in /dev/shm that the generator's parameters
        # are views of; every rank writes its own rows of each sharded parameter into it.
        plan = worker.weight_export_plan(setup.bucket_bytes)
        worker.finish_weight_export()
        shared: list[Any] = [None]
        if lead:
            layout = RegionLayout.of([spec for bucket in plan.buckets for spec in bucket])
            to_parent.put(("region_layout", layout))
            shared = [(expect(to_rank0, "region_path"), layout)]
        if world > 1:
            dist.broadcast_object_list(shared, src=0)
        path, layout = shared[0]
        stats = worker.write_weights_to_region(path, layout, setup.bucket_bytes)
        barrier(world)
        if lead:
            to_parent.put(("region_written", stats))
            expect(to_rank0, "ack")
        barrier(world)
        worker.release_weight_region(path)
    # Each case builds its own worker on the process group that ``worker`` joined, whose
    # shutdown ends that group: so the cases run first.
    run_cases(rank, world, setup, policy_config(setup))
    if lead:
        to_parent.put(("done", None))
    worker.shutdown()


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def expect(inbox: Any, kind: str) -> Any:
    got, payload = inbox.get()
    if got != kind:
        raise RuntimeError(f"expected {kind!r} from the parent, got {got!r}")
    return payload


# -- this process: the generation worker, the references and the checks ------------------------


class Report:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0

    def check(self, name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(name)


class Ranks:
    """The spawned ranks of one world and the two queues to and from rank 0."""

    def __init__(self, world: int, setup: Setup, env: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        args = (world, setup, self.inbox, self.outbox)
        with environment(env):  # spawned processes take the environment of this moment
            self.procs = [ctx.Process(target=policy_rank, args=(r, *args)) for r in range(world)]
            for p in self.procs:
                p.start()

    def receive(self, *kinds: str, timeout_s: float = 1800) -> tuple[str, Any]:
        """The next message from policy rank 0, which must be one of ``kinds``."""
        for _ in range(int(timeout_s)):
            try:
                got, payload = self.inbox.get(timeout=1)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a policy rank exited ({dead}) before {kinds}") from None
                continue
            if got == "error":
                raise RuntimeError(payload)
            if got not in kinds:
                raise RuntimeError(f"expected {kinds} from policy rank 0, got {got!r}")
            return got, payload
        raise TimeoutError(f"nothing from policy rank 0 in {timeout_s:.0f} s (waiting for {kinds})")

    def expect(self, kind: str) -> Any:
        return self.receive(kind)[1]

    def reply(self, kind: str, payload: Any = None) -> None:
        self.outbox.put((kind, payload))

    def close(self, timeout_s: float) -> list[int | None]:
        """Wait up to ``timeout_s`` for every rank to exit, then end the ones left.

        ``Process.join`` waits for the rank's sentinel pipe to close, which can be much later
        than its exit: the ``torch_shm_manager`` that a rank starts for CPU IPC handles inherits
        that pipe and lives on while this process still maps the shared weights. ``exitcode``
        asks the operating system for the exit status itself.
        """
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if not exited(p, deadline):
                p.terminate()
                if not exited(p, time.monotonic() + 10):
                    p.kill()
                    exited(p, time.monotonic() + 10)
        return [p.exitcode for p in self.procs]


def exited(process: Any, deadline: float) -> bool:
    """Whether ``process`` has exited by ``deadline`` (``exitcode``, not ``join``: see above)."""
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return process.exitcode is not None


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@torch.no_grad()
def scramble(generator: HfGenerationWorker) -> None:
    """NaN in every parameter, so weights equal after a transfer can only have come through."""
    for p in generator.params.values():
        p.fill_(float("nan"))


def compare_weights(generator: HfGenerationWorker, sent: dict[str, torch.Tensor]) -> str | None:
    """None if every generator parameter equals the sent tensor bit for bit, else what differs."""
    got = generator.get_weights()
    missing = sorted(set(got) - set(sent))
    unequal = sorted(n for n in got if n in sent and not torch.equal(got[n], sent[n]))
    if missing or unequal:
        return f"not sent: {missing[:3]}; unequal: {unequal[:3]} ({len(unequal)} in all)"
    return None


def transfer_ipc(ranks: Ranks, generator: HfGenerationWorker, final: dict, version: int) -> str:
    """Receive policy rank 0's buckets over the IPC channel; what arrived, or raise."""
    scramble(generator)
    generator.prepare_for_weight_update()
    buckets = nbytes = 0
    while True:
        kind, bucket = ranks.receive("ipc_bucket", "ipc_done")
        if kind == "ipc_done":
            break
        generator.receive_weight_bucket_ipc(bucket)
        buckets += 1
        nbytes += sum(slot.nbytes for slot in bucket.slots)
        ranks.reply("ack")
    generator.set_weight_version(version)
    differs = compare_weights(generator, final)
    if differs:
        raise AssertionError(differs)
    return f"{buckets} bucket(s), {nbytes / 2**20:.2f} MiB, all equal"


def transfer_region(ranks: Ranks, generator: HfGenerationWorker, final: dict, world: int) -> str:
    layout = ranks.expect("region_layout")
    scramble(generator)
    generator.prepare_for_weight_update()
    path, reason = generator.map_weight_region(None, layout)
    if path is None:
        raise RuntimeError(f"the generator cannot map a weight region: {reason}")
    ranks.reply("region_path", path)
    stats = ranks.expect("region_written")
    generator.commit_weight_region(path, layout.digest, version=world)
    generator.unlink_weight_region(path)
    differs = compare_weights(generator, final)
    ranks.reply("ack")
    if differs:
        raise AssertionError(differs)
    return f"{stats['bytes_written'] / 2**20:.2f} MiB written by rank 0 into {path}, all equal"


def prompts(vocab: int, lengths: tuple[int, ...] = (5, 12, 1, 8)) -> BatchedDataDict:
    gen = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    ids = ids * (torch.arange(width)[None] < torch.tensor(lengths)[:, None])
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(lengths))


@torch.no_grad()
def check_generation(
    generator: HfGenerationWorker, setup: Setup, weights: dict, new_tokens: int, report: Report
) -> None:
    ref = reference_model(setup.hf_config, weights)
    vocab = setup.hf_config["vocab_size"]
    data = prompts(vocab)
    lengths = data["input_lengths"]
    where = f"generation on {generator.device}"
    for greedy in (True, False):
        kind = "greedy" if greedy else "sampled"
        out = generator.generate(data, greedy=greedy)
        ids, logprobs = out["output_ids"].cpu(), out["logprobs"].cpu().to(torch.float64)
        ids_ok = bool(((ids >= 0) & (ids < vocab)).all())
        prompt_kept = all(
            torch.equal(ids[i, :n], data["input_ids"][i, :n]) for i, n in enumerate(lengths)
        )
        lengths_ok = bool((out["generation_lengths"].cpu() == new_tokens).all()) and bool(
            (out["unpadded_sequence_lengths"].cpu() == lengths + new_tokens).all()
        )
        report.check(
            f"{where}: {kind} token ids and lengths",
            ids_ok and prompt_kept and lengths_ok,
            f"ids in [0, {vocab}): {ids_ok}; prompts kept: {prompt_kept}; every row "
            f"{new_tokens} new tokens (no stop tokens): {lengths_ok}",
        )
        errors, agree, checked, first_agree, first_checked = [], 0, 0, 0, 0
        for i, n in enumerate(lengths.tolist()):
            seq = ids[i, : n + new_tokens]
            logits = ref(input_ids=seq[None]).logits[0].to(torch.float64)
            logp = torch.log_softmax(logits, dim=-1)
            for t in range(n - 1, n + new_tokens - 1):  # position t predicts token t + 1
                errors.append(abs(float(logprobs[i, t + 1] - logp[t, seq[t + 1]])))
                top2 = logits[t].topk(2).values
                if greedy and float(top2[0] - top2[1]) > ARGMAX_MARGIN:
                    hit = int(seq[t + 1]) == int(logits[t].argmax())
                    agree, checked = agree + hit, checked + 1
                    if t == n - 1:
                        first_agree, first_checked = first_agree + hit, first_checked + 1
        if greedy:
            report.check(
                f"{where}: greedy tokens = argmax of the float64 logits",
                agree == checked and first_checked >= len(lengths) // 2,
                f"first tokens {first_agree}/{first_checked}, all tokens {agree}/{checked} "
                f"(positions whose top two logits differ by > {ARGMAX_MARGIN})",
            )
        worst = max(errors)
        report.check(
            f"{where}: {kind} log-probs (float32) vs float64",
            worst <= FP32_LOGPROB_MAX,
            f"max |error| {worst:.2e} (<= {FP32_LOGPROB_MAX}) over {len(errors)} tokens",
        )


def run_world(
    world: int,
    setup: Setup,
    generator: HfGenerationWorker,
    report: Report,
    reference: Reference,
    new_tokens: int,
) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if gpus and gpus < world:  # NCCL wants a GPU per rank: run these ranks on the CPU (gloo)
        env["CUDA_VISIBLE_DEVICES"] = ""
        print(f"world {world}: {gpus} GPU for {world} ranks, so gloo on the CPU", flush=True)
    if not gpus or gpus < world:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    start = time.perf_counter()
    ranks = Ranks(world, setup, env)
    finished = False
    try:
        ranks.expect("trained")
        results = [torch.load(setup.result_file(world, r)) for r in range(world)]
        check_rows(world, results, report, reference)
        final, policy_device = results[0]["final"], results[0]["device"]
        carrier = (
            "CUDA IPC handles to device memory"
            if policy_device.startswith("cuda")
            else "no GPU: the same IPC handles carry shared CPU storage (torch's file_system "
            "sharing), the CPU stand-in for CUDA IPC"
        )
        name = f"world {world}: weights from policy rank 0 ({policy_device}) to the generation "
        name += f"worker ({generator.device}, another process), IPC channel; {carrier}"
        try:
            report.check(name, True, transfer_ipc(ranks, generator, final, version=world))
        except AssertionError as e:
            report.check(name, False, str(e))
        if world == 1:
            check_generation(generator, setup, final, new_tokens, report)
        if results[0]["device"] == "cpu" and generator.device.type == "cpu":
            name = f"world {world}: weights over the shared-memory region channel (CPU)"
            try:
                report.check(name, True, transfer_region(ranks, generator, final, world))
            except AssertionError as e:
                report.check(name, False, str(e))
        ranks.expect("done")
        check_cases(world, report, reference)
        finished = True
    finally:
        # After a failure here the ranks may wait for a reply that never comes: end them soon.
        codes = ranks.close(timeout_s=60 if finished else 5)
    report.check(
        f"world {world}: every rank exited cleanly",
        codes == [0] * world,
        f"exit codes {codes}; {time.perf_counter() - start:.0f} s for this world",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=mfu.MODELS, default=None, help="default: by device")
    parser.add_argument("--longest", type=int, default=None, help="longest checked sequence")
    parser.add_argument("--logprob-chunk-size", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8, help="generated per prompt")
    parser.add_argument("--mfu-sequences", type=int, default=64)
    parser.add_argument("--mfu-longest", type=int, default=None)
    parser.add_argument("--mfu-steps", type=int, default=3)
    parser.add_argument("--mfu-matmul-size", type=int, default=None)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    model_name = args.model or ("qwen2-0.5b" if cuda else "tiny")
    hf_config = check_config(model_name)
    device = torch.cuda.get_device_name() if cuda else "CPU (no CUDA device)"
    print(f"gpu_check: {device}, torch {torch.__version__}, model {model_name}", flush=True)
    torch.manual_seed(0)
    lengths = mfu.skewed_lengths(8, args.longest or (256 if cuda else 48))
    report = Report()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as out_dir:
        setup = Setup(
            model_name=model_name,
            hf_config=hf_config,
            batch=mfu.make_batch(lengths, hf_config["vocab_size"]),
            chunk_size=args.logprob_chunk_size,
            bucket_bytes=4 * 2**20,
            out_dir=out_dir,
        )
        sampling = {"max_new_tokens": args.new_tokens, "stop_token_ids": []}
        generator = HfGenerationWorker(
            GenerationConfig(backend="hf", sampling=sampling).model_dump(),
            {"hf_config": hf_config, "dtype": "float32"},
        )
        reference = Reference(setup)
        for world in (1, 2):
            try:
                run_world(world, setup, generator, report, reference, args.new_tokens)
            except Exception as e:
                report.check(f"world {world}", False, f"stopped: {e}")
        generator.shutdown()
        del generator
    ok = not report.failed
    print(
        f"{report.passed} checks passed, {len(report.failed)} failed"
        + (f": {', '.join(report.failed)}" if report.failed else ""),
        flush=True,
    )

    print("MFU (bench/mfu.py: packed bf16 training steps of the same model):", flush=True)
    try:
        mfu.run(
            model_name,
            sequences=args.mfu_sequences,
            longest=args.mfu_longest,
            mixed_precision="bfloat16",
            steps=args.mfu_steps,
            matmul_size=args.mfu_matmul_size,
            report=lambda line: print(f"  {line}", flush=True),
        )
    except Exception:
        ok = False
        print(f"FAIL MFU: {traceback.format_exc()}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
