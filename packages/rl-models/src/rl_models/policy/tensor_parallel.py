"""Tensor and sequence parallelism of a Hugging Face causal LM over the ``tp`` dimension of the
worker's mesh (``("dp", "tp")``, or ``("dp", "cp", "tp")`` with context parallelism).

``parallelize`` splits every decoder layer's matrices over the ``tp`` ranks with torch's
``parallelize_module`` (Megatron's layout): attention's q/k/v projections and the MLP's
gate/up projections by output columns, attention's o projection and the MLP's down
projection by input rows, so each rank computes its own attention heads and MLP columns and
one all-reduce per block joins them. The embedding is split by vocabulary rows; the output
layer by vocabulary rows too, its output left split over the vocabulary: log-probs are then
computed from the slices (``logprobs.vocab_parallel_logprobs``), never from a whole row of
logits on one rank. FSDP2 then shards the result over the ``dp`` ranks (``dp`` and ``cp``
with context parallelism; the worker's ``_shard``).

With sequence parallelism the activations between the blocks (the norms, the residual stream)
are split along the sequence as well: the all-reduces become a reduce-scatter after each block
and an all-gather before the next, and each rank holds ``1/tp`` of those activations.

Only model families whose module names and attention layout are known get a plan (Llama,
Qwen2 and Qwen3: their q/k/v outputs are whole heads, ``view(..., -1, head_dim)`` takes the
local head count); any other is refused by name rather than split wrongly.

Qwen3 normalises each query and key head (``q_norm``, ``k_norm``, RMSNorms over ``head_dim``)
between the projections and attention. Their weights are whole on every rank, but each rank
applies them to its own heads only, so the gradient a rank computes for them is its heads'
share: summed over the ``tp`` ranks it is the whole gradient. The plan makes those weights
replicated DTensors and the norms' inputs DTensors split by heads (``_per_head_norm``), so
autograd leaves their gradients as pending sums (``Partial``); FSDP2 lays each gradient out
as its parameter is before reducing it over ``dp``, which for these is an all-reduce over
``tp``, as for the norms' weights under sequence parallelism. Left plain, each rank would step
with its own heads' share and the copies would drift apart (the two-rank Qwen3 case fails so).
Under bf16 mixed precision that all-reduce, like the sequence-parallel norms', comes before
FSDP's float32 reduction and sums the gradient in the dtype it has then: bfloat16 when the
step is one micro-batch, float32 when it accumulates several (FSDP keeps the sum of earlier
micro-batches' gradients in float32).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

#: The mesh dimensions: data parallel (FSDP2), tensor parallel.
MESH_DIMS = ("dp", "tp")

#: Model families (``config.model_type``) with a plan.
PLANNED_FAMILIES = ("llama", "qwen2", "qwen3")

#: Per-head norms of the queries and keys (Qwen3), relative to a decoder layer.
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


class VocabParallelOutput(ColwiseParallel):
    """The output layer split by vocabulary rows, its output left split over the vocabulary.

    While the layer computes log-probs itself (``logprobs.output_layer_computes_logprobs``)
    its forward returns a plain tensor, the same on every rank: that passes through as it is,
    where torch's output hook would re-lay it out as logits."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, outputs, device_mesh
        )


def check_plannable(hf_config: Any, tp: int) -> None:
    """Refuse, by name, a model ``tensor_parallel_size`` ``tp`` cannot split."""
    family = getattr(hf_config, "model_type", None)
    where = "policy.dtensor.tensor_parallel_size"
    if family not in PLANNED_FAMILIES:
        raise ValueError(
            f"{where}={tp}: no tensor-parallel plan for model type {family!r} (planned: "
            f"{', '.join(PLANNED_FAMILIES)}); use tensor_parallel_size 1 for it"
        )
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(hf_config, key)
        if heads % tp:
            raise ValueError(
                f"{where}={tp}: the model's {key}={heads} is not divisible by it (each rank "
                "computes whole attention heads)"
            )


def _per_head_norm() -> SequenceParallel:
    """The style of a norm over ``head_dim`` applied to this rank's heads, ``[B, S, heads,
    head_dim]`` with ``heads`` split over ``tp`` (dim 2).

    Torch's ``SequenceParallel`` style does what such a norm needs, on any dimension: it makes
    the weight a replicated DTensor (ones at build, then the same initialisation or file on
    every rank, ``build.py``) and wraps the local input as split along ``sequence_dim``, so
    the weight's gradient, a sum over the split heads, comes out as a pending sum that is
    reduced over the ranks. Its output goes back to a plain tensor of the local heads, which
    is what the attention code after it expects."""
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def _has_module(root: torch.nn.Module, name: str) -> bool:
    try:
        root.get_submodule(name)
    except AttributeError:
        return False
    return True


def _has_head_norms(layer: torch.nn.Module, where: str) -> bool:
    """Whether decoder ``layer`` (named ``where`` in the model) has per-head query and key
    norms (``HEAD_NORMS``). A layer with some of them but not all is refused, naming the
    missing one: the plan covers both or neither, and a head norm left out of it would step
    with each rank's own heads' share of its gradient."""
    present = [name for name in HEAD_NORMS if _has_module(layer, name)]
    missing = [name for name in HEAD_NORMS if name not in present]
    if present and missing:
        raise ValueError(
            f"no tensor-parallel plan for {where}: it has {present[0]} but no {missing[0]} "
            "(the per-head query and key norms are planned together)"
        )
    return bool(present)


def _layer_plan(sequence_parallel: bool, head_norms: bool) -> dict[str, Any]:
    """One decoder layer's plan (module names relative to the layer); ``head_norms``: the
    layer has per-head query and key norms (Qwen3)."""
    norms = {name: _per_head_norm() for name in HEAD_NORMS} if head_norms else {}
    if not sequence_parallel:
        return norms | {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    # The residual stream stays a DTensor split along the sequence (Shard(1)), so Hugging
    # Face's code, which reads the sequence length off it (masks, positions), sees the global
    # shape. Each block gathers the sequence at its entry and reduce-scatters at its exit.
    gather = {"hidden_states": Shard(1)}, {"hidden_states": Replicate()}
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts=gather[0], desired_input_kwarg_layouts=gather[1]
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        **norms,
    }


def parallelize(model: torch.nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split ``model`` (a Llama/Qwen2/Qwen3 causal LM, on any device, meta included) over the 1-D
    tensor-parallel ``mesh`` in place (see the module docstring)."""
    check_plannable(model.config, mesh.size())
    # Checked for every layer before any is split, so that a refusal leaves the model whole.
    layers = model.model.layers
    head_norms = [_has_head_norms(layer, f"model.layers.{i}") for i, layer in enumerate(layers)]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    between = Shard(1) if sequence_parallel else Replicate()
    root = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(),
            output_layouts=between,
            use_local_output=not sequence_parallel,
        ),
        "lm_head": VocabParallelOutput(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sequence_parallel:
        root["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, root)
    for layer, norms in zip(layers, head_norms, strict=True):
        parallelize_module(layer, mesh, _layer_plan(sequence_parallel, norms))
    if tied:
        # Each style distributed its own copy of the shared weight: share one again (the
        # embedding's and the output layer's rows are split alike, Shard(0)).
        model.lm_head.weight = model.model.embed_tokens.weight


def grad_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all gradients, as a plain tensor, over parameters that may live on
    different meshes (without sequence parallelism the norms' weights are not split by
    tensor parallelism, so FSDP2 shards them over ``dp`` alone while the rest span
    ``("dp", "tp")``); torch's own ``clip_grad_norm_`` cannot add DTensors of two meshes."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p.grad)
    squares = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.double().square())
    return torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)


def clip_grads(parameters: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Scale the gradients to a 2-norm of at most ``max_norm`` (None: leave them); the norm
    before clipping."""
    norm = grad_norm(parameters)
    if max_norm is not None and math.isfinite(max_norm):
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype).item())
    return float(norm)
