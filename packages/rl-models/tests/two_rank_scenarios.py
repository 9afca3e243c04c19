"""Run by ``test_two_ranks.py`` under ``torch.distributed.run`` with two gloo ranks.

Each rank runs every scenario on its half of the batch and saves what it saw to
``<out>/rank<r>.pt``; the tests compare those against single-process references. One launch
for all scenarios: starting two processes that import torch and transformers costs more than
the scenarios themselves.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import sys

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

sys.path.insert(0, os.path.dirname(__file__))
from conftest import (
    TINY_LLAMA,
    TINY_QWEN3,
    WidestVocabTensor,
    float64_rms_norm,
    grouped_batch,
    initial_model,
    skewed_batch,
    tiny_config,
)

from rl_models.interfaces import Values
from rl_models.losses import NLLLoss
from rl_models.policy import segment_attention
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.resident_memory import peak_since, reset_peak

# Big enough that a whole copy (~110 MB in float32) stands far above the noise of a process's
# resident memory; most of it in the decoder layers, as in real models.
BIG_LLAMA = {
    **TINY_LLAMA,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 4096,
}


def build_memory() -> dict[str, int]:
    """Peak resident memory added while this rank builds a model from config."""
    config = tiny_config(model={"hf_config": BIG_LLAMA, "dtype": "float32"})
    before = reset_peak()
    worker = DTensorPolicyWorker(config)
    peak = peak_since(before)
    full = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    del worker
    gc.collect()
    return {"build_peak_bytes": peak, "full_model_bytes": full}


def reward_scores(half) -> dict:
    rm = DTensorPolicyWorker(
        tiny_config(
            model={
                "hf_config": TINY_LLAMA,
                "dtype": "float64",
                "kind": "sequence_classification",
                "num_labels": 2,
            },
            logprob_micro_batch_size=3,
        )
    )
    return {"scores": rm.get_scores(half)["scores"]}


def bf16_reference(half) -> dict:
    worker = DTensorPolicyWorker(
        tiny_config(
            model={"hf_config": TINY_LLAMA, "dtype": "float32"},
            mixed_precision="bfloat16",
            reference_policy={"enabled": True},
        )
    )
    return {
        "policy_logprobs": worker.get_logprobs(half)["logprobs"],
        "reference_logprobs": worker.get_reference_policy_logprobs(half)["reference_logprobs"],
    }


def dropout_draws(worker: DTensorPolicyWorker) -> torch.Tensor:
    """The first numbers dropout would draw in the worker's next optimiser step."""
    with worker._seeded_dropout():
        return torch.rand(8)


def one_step(half) -> dict:
    """One SGD step over 4 micro-batches per rank, counting FSDP's gradient reductions."""
    worker = DTensorPolicyWorker(tiny_config(train_micro_batch_size=1))
    reductions = []
    original = _fsdp_param_group.foreach_reduce

    def counting_reduce(*args, **kwargs):
        reductions.append(1)
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_reduce = counting_reduce
    try:
        worker.train(half, NLLLoss())
    finally:
        _fsdp_param_group.foreach_reduce = original
    return {
        "gradient_reductions": len(reductions),
        "fsdp_groups": sum(isinstance(m, FSDPModule) for m in worker.model.modules()),
        "grads_freed_after_step": [p.grad is None for p in worker.model.parameters()],
        "dropout_draws": dropout_draws(worker),
        "trained_weights": get_model_state_dict(
            worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        ),
    }


def shared_prefix_step(rank: int) -> dict:
    """One SGD step on GRPO-like groups (6 rows per rank), each rank running its groups'
    prompts once (RMSNorm in float64, see ``conftest.float64_rms_norm``)."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRMSNorm.forward
    modeling_llama.LlamaRMSNorm.forward = float64_rms_norm
    try:
        half = grouped_batch().slice(rank * 6, rank * 6 + 6)
        config = tiny_config(train_global_batch_size=12, train_micro_batch_size=6)
        worker = DTensorPolicyWorker(config)
        # pi_old as GRPO asks for it, before the step: each rank's groups' prompts once.
        at_loss = worker.get_logprobs(half, at_loss_tokens=True)["logprobs"]
        embedded, segment_calls = [], []
        worker.model.get_input_embeddings().register_forward_pre_hook(
            lambda _m, args: embedded.append(int(args[0].numel()))
        )
        segment_attention.AttentionInterface.register(
            segment_attention.NAME,
            lambda *a, **k: segment_calls.append(1) or segment_attention.segment_attention(*a, **k),
        )
        worker.train(half, NLLLoss())
        weights = get_model_state_dict(
            worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {
            "loss_token_logprobs": at_loss,
            "trained_weights": weights,
            "embedded": embedded,
            "segments": len(segment_calls),
        }
    finally:
        segment_attention.AttentionInterface.register(
            segment_attention.NAME, segment_attention.segment_attention
        )
        modeling_llama.LlamaRMSNorm.forward = original


def pretrained(half, out: str) -> dict:
    """A saved model, loaded by each rank as slices of the safetensors file (tied output
    layer: the file holds the embedding only)."""
    path = os.path.join(out, "pretrained")
    if int(os.environ["RANK"]) == 0:
        initial_model(
            seed=3, hf_config={**TINY_LLAMA, "tie_word_embeddings": True}
        ).save_pretrained(path)
    torch.distributed.barrier()
    worker = DTensorPolicyWorker(tiny_config(model={"path": path, "dtype": "float64"}))
    return {"logprobs": worker.get_logprobs(half)["logprobs"]}


def critic_step(half, out: str) -> dict:
    """A critic built from a saved causal LM (each rank reads its slices; the value head,
    absent from the files, drawn from the seed): values, then one step of a value loss."""

    class HalfSquaredError:
        input_type = Values

        def __call__(self, values, data, global_valid_seqs, global_valid_toks):
            mask = data.loss_token_mask().to(values)
            err = torch.where(mask > 0, values - 1.0, 0.0)
            return 0.5 * (err.square() * mask).sum() / global_valid_toks.to(values), {}

    path = os.path.join(out, "pretrained")  # written by the `pretrained` scenario
    config = tiny_config(model={"path": path, "dtype": "float64", "kind": "value"}, seed=4)
    worker = DTensorPolicyWorker(config)
    values = worker.get_values(half)
    worker.train(half, HalfSquaredError())
    return {
        "values": values["values"],
        "final_values": values["final_values"],
        "trained_values": worker.get_values(half)["values"],
    }


def reward_from_lm(half, out: str) -> dict:
    """A reward model built from a saved causal LM: each rank reads its slices, and the score
    head, absent from the files, is drawn from the seed."""
    path = os.path.join(out, "pretrained")  # written by the `pretrained` scenario
    model = {"path": path, "dtype": "float64", "kind": "sequence_classification"}
    worker = DTensorPolicyWorker(tiny_config(model=model, seed=4, checkpoint={"sharded": True}))
    # Each rank writes its shards; the checkpoint's config must name the reward model's class.
    saved = os.path.join(out, "reward_model")
    worker.save_checkpoint(saved)
    with open(os.path.join(saved, "config.json")) as f:
        architectures = json.load(f)["architectures"]
    files = glob.glob(os.path.join(saved, "*.safetensors"))  # the consolidated files
    score = next(w["score.weight"] for w in map(load_file, files) if "score.weight" in w)
    return {
        "scores": worker.get_scores(half)["scores"],
        "saved_architectures": architectures,
        "saved_score": score,
    }


def teacher_topk(half) -> dict:
    """A teacher's chunked top-k log-probs (what distillation's loss reads), sharded by FSDP2."""
    worker = DTensorPolicyWorker(tiny_config(logprob_chunk_size=6))
    return dict(worker.get_topk_logprobs(half, k=5))


def region_write(half, out: str) -> dict:
    """After a training step, both ranks write their row shards of an FSDP2 model with uneven
    shards (vocabulary 131: rows 0..65 and 66..130) into one shared weight region."""
    from rl_models.weight_transfer.shared_memory import MappedRegion, RegionLayout, create_region

    config = tiny_config(
        model={"hf_config": {**TINY_LLAMA, "vocab_size": 131, "intermediate_size": 100}}
    )
    worker = DTensorPolicyWorker(config)
    worker.train(half, NLLLoss())
    plan = worker.weight_export_plan(bucket_bytes=1 << 16)
    worker.finish_weight_export()
    shared = [None]
    if int(os.environ["RANK"]) == 0:
        layout = RegionLayout.of([s for bucket in plan.buckets for s in bucket])
        shared = [(create_region(layout.nbytes, out), layout)]
    torch.distributed.broadcast_object_list(shared, src=0)
    path, layout = shared[0]
    stats = worker.write_weights_to_region(path, layout, bucket_bytes=1 << 16)
    torch.distributed.barrier()
    full = get_model_state_dict(
        worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    region = {n: t.clone() for n, t in MappedRegion(path, layout).views.items()}
    return {"bytes_written": stats["bytes_written"], "region": region, "full": full}


#: Tensor-parallel cases (``dtensor`` section, loss, other config), on both ranks' whole batch.
TINY_QWEN2 = {**TINY_LLAMA, "model_type": "qwen2", "tie_word_embeddings": True}
# Its vocabulary (150) and a rank's half of it (75) are no other dimension of the model.
QWEN3_ODD_VOCAB = {**TINY_QWEN3, "vocab_size": 150}
TENSOR_PARALLEL_CASES = {
    # Norms' weights on the dp mesh only, the rest on (dp, tp): the gradient norm spans both
    # (clipped: the norm is ~1.8).
    "llama-tp2-clipped": ({"tensor_parallel_size": 2}, "nll", {"max_grad_norm": 0.5}),
    # Sequence parallel, trained with an entropy bonus (log-probs at the loss tokens only);
    # each rank writes its own shards of the checkpoint.
    "llama-tp2-sp-entropy": (
        {"tensor_parallel_size": 2, "sequence_parallel": True},
        "entropy",
        {"checkpoint": {"sharded": True}},
    ),
    # Qwen2: tied output layer, q/k/v biases; packed rows through the sequence-split blocks.
    "qwen2-tp2-sp-packed": (
        {"tensor_parallel_size": 2, "sequence_parallel": True},
        "nll",
        {
            "model": {"hf_config": TINY_QWEN2, "dtype": "float64"},
            "sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 64},
        },
    ),
    # Qwen3, sequence parallel: per-head norms of the queries and keys (q_norm, k_norm), whose
    # weights every rank holds whole but applies to its own heads only.
    "qwen3-tp2-sp": (
        {"tensor_parallel_size": 2, "sequence_parallel": True},
        "nll",
        {"model": {"hf_config": QWEN3_ODD_VOCAB, "dtype": "float64"}},
    ),
    # Qwen3 without sequence parallelism: the head norms' weights span (dp, tp) while the
    # other norms' sit on dp alone, so the clipped gradient norm adds the two meshes' parts
    # (the norm is ~1.95).
    "qwen3-tp2-clipped": (
        {"tensor_parallel_size": 2},
        "nll",
        {"model": {"hf_config": QWEN3_ODD_VOCAB, "dtype": "float64"}, "max_grad_norm": 1.0},
    ),
}


def tensor_parallel_config(case: str, tp: bool = True):
    """The config of a tensor-parallel case (``tp=False``: the same without tp)."""
    dtensor, _, extra = TENSOR_PARALLEL_CASES[case]
    config = {"logprob_chunk_size": 7, "dynamic_batching": {"enabled": False}, **extra}
    return tiny_config(**config, **({"dtensor": dtensor} if tp else {}))


def test_module(name: str):
    """A test module of this directory, imported as part of a package so that its relative
    imports (``from .conftest import ...``) resolve as they do under pytest."""
    import importlib
    import types

    if "rl_models_tests" not in sys.modules:
        package = types.ModuleType("rl_models_tests")
        package.__path__ = [os.path.dirname(__file__)]
        sys.modules["rl_models_tests"] = package
    return importlib.import_module(f"rl_models_tests.{name}")


def tensor_parallel_loss(case: str):
    EntropyBonusLoss = test_module("test_token_entropy").EntropyBonusLoss
    return EntropyBonusLoss() if TENSOR_PARALLEL_CASES[case][1] == "entropy" else NLLLoss()


def asked_token_ids(data, k: int = 3) -> torch.Tensor:
    """``[B, S, k]`` token ids to ask each position's distribution about (a teacher's top-k)."""
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, TINY_LLAMA["vocab_size"], (*data["input_ids"].shape, k), generator=gen)


def tensor_parallel(case: str, out: str) -> dict:
    """tp=2 over both ranks (dp=1), each given the whole batch: log-probs with entropies, at
    given token ids, and the top-k; one SGD step, the weights exported in buckets and a
    checkpoint written (rank 0 reads it). Meanwhile, up to the step's end, the most rows any
    tensor as wide as the whole vocabulary had on this rank, and as wide as its half."""
    exported = test_module("test_weight_export").exported
    from rl_distributed.batched_data_dict import BatchedDataDict
    from rl_models.policy.forward import TokenLogprobs

    data = skewed_batch()
    worker = DTensorPolicyWorker(tensor_parallel_config(case))
    vocab = worker.model.config.vocab_size
    whole, half = WidestVocabTensor(vocab), WidestVocabTensor(-(-vocab // 2))
    with whole, half:
        with torch.no_grad():
            logprobs_entropy = worker._per_row(worker.model, data, TokenLogprobs(entropy=True))
            asked = BatchedDataDict({**data, "teacher_topk_ids": asked_token_ids(data)})
            gathered = worker._per_row(worker.model, asked, TokenLogprobs(teacher_topk=True))
        topk = dict(worker.get_topk_logprobs(data, k=5))
        grad_norm = worker.train(data, tensor_parallel_loss(case)).metrics["grad_norm"]
    weights, _ = exported([worker._weight_exporter()], bucket_bytes=1 << 14)
    path = os.path.join(out, f"checkpoint-{case}")
    worker.save_checkpoint(path)
    saved = {}
    if int(os.environ["RANK"]) == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    return {
        "logprobs_entropy": logprobs_entropy,
        "gathered": gathered,
        "topk": topk,
        "grad_norm": grad_norm,
        "exported": weights,
        "checkpoint": saved,
        "whole_vocab_rows": whole.rows,
        "half_vocab_rows": half.rows,
    }


def long_documents(lengths=(37, 90, 19)) -> object:
    """Three documents of uneven lengths, right-padded to the longest (a loss on the second
    half of each): packed, one row of 146 tokens, which context parallelism pads to 148."""
    return skewed_batch(lengths=lengths, seed=7)


def context_parallel_config(cp: bool = True, tp: int = 1, **extra):
    """cp=2 over both ranks (dp=1) on packed rows (``cp=False``: the same without cp); with
    ``tp`` > 1 each cp rank split by tensor (and sequence) parallelism too; ``extra``: other
    config."""
    dtensor = {"context_parallel_size": 2} if cp else {}
    if tp > 1:
        dtensor |= {"tensor_parallel_size": tp, "sequence_parallel": True}
    return tiny_config(
        train_global_batch_size=3,
        train_micro_batch_size=3,
        logprob_chunk_size=16,
        dynamic_batching={"enabled": False},
        sequence_packing={"enabled": True, "max_tokens_per_microbatch": 256},
        **({"dtensor": dtensor} if dtensor else {}),
        **extra,
    )


def context_parallel() -> dict:
    """cp=2, each rank given the whole batch: log-probs, entropies and the top-k of the
    packed row, then one SGD step (gradient norm and the trained weights, gathered)."""
    from rl_models.policy.forward import TokenLogprobs

    data = long_documents()
    worker = DTensorPolicyWorker(context_parallel_config())
    logprobs = worker.get_logprobs(data)["logprobs"]
    entropy = worker._per_row(worker.model, data, TokenLogprobs(entropy=True))[..., 1]
    topk = dict(worker.get_topk_logprobs(data, k=5))
    grad_norm = worker.train(data, NLLLoss()).metrics["grad_norm"]
    weights = get_model_state_dict(
        worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {
        "logprobs": logprobs,
        "entropy": entropy,
        "topk": topk,
        "grad_norm": grad_norm,
        "trained_weights": weights,
    }


def main(out: str, only: list[str]) -> None:
    """Every scenario runs even if another fails; a failure is saved as its message.
    ``only``: run just the scenarios whose names contain one of these (all when empty)."""
    rank = int(os.environ["RANK"])
    half = skewed_batch().slice(rank * 4, rank * 4 + 4)
    results: dict = {}
    scenarios = {
        "build_memory": build_memory,  # first: before other models raise the process's peak
        "reward_scores": lambda: reward_scores(half),
        "bf16_reference": lambda: bf16_reference(half),
        "one_step": lambda: one_step(half),
        "shared_prefix_step": lambda: shared_prefix_step(rank),
        "pretrained": lambda: pretrained(half, out),
        "critic_step": lambda: critic_step(half, out),
        "reward_from_lm": lambda: reward_from_lm(half, out),
        "teacher_topk": lambda: teacher_topk(half),
        "region_write": lambda: region_write(half, out),
        **{
            f"tensor_parallel/{case}": lambda case=case: tensor_parallel(case, out)
            for case in TENSOR_PARALLEL_CASES
        },
        "context_parallel": context_parallel,
    }
    for name, scenario in scenarios.items():
        if only and not any(part in name for part in only):
            continue
        try:
            results[name] = scenario()
        except Exception as e:
            # Both ranks fail alike in these scenarios, so the next one can still run.
            results[name] = f"{type(e).__name__}: {e}"
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
