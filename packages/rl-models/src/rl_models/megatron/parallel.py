"""Megatron-core model parallelism for the policy worker: building a rank's ``GPTModel`` piece,
moving weights between ranks and synchronising gradients.

Ranks are numbered the way ``parallel_state.initialize_model_parallel`` numbers them by default
(tensor parallel fastest, then data parallel, then pipeline stage), which is the layout the
driver-side ``Policy`` gives its workers. Gradient reductions Megatron leaves to its DDP wrapper
and ``finalize_model_grads`` are done here, without them (no bucketing or overlap: the worker
keeps plain ``torch.optim`` optimisers over plain parameters):

* data parallel: every gradient summed over the replicas (losses are already global means);
* tied embeddings with pipeline parallelism: the first stage's embedding and the last stage's
  copy used as output layer get the sum of both gradients, so they stay equal;
* sequence parallelism: replicated parameters (RMSNorm weights) see only this rank's part of the
  sequence, so their gradients are summed over the tensor-parallel group; so are the query/key
  norms' (Qwen3), which see only this rank's heads;
* expert parallelism (mixture-of-experts models): the ``ep`` ranks of an expert group are
  data-parallel ranks for everything but the experts, each holding ``E/ep`` of each layer's
  experts (Megatron marks expert weights ``allreduce=False``); expert gradients are summed over
  the expert-data-parallel group only (the replicas holding the same experts), every other
  gradient over the whole data-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    param_is_not_tensor_parallel_duplicate,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from transformers import PretrainedConfig

from rl_models.megatron.convert import (
    GPTLayout,
    check_expert_numbering,
    check_expert_parallel,
    experts_to_global,
    in_first_expert_group,
    megatron_to_hf,
    padded_vocab_size,
    stage_layers,
    unshard_megatron,
)
from rl_models.policy.config import MegatronConfig


@dataclass(frozen=True)
class Ranks:
    """This process's place in the ``[pipeline, data, tensor]`` grid of ranks."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep: int = 1
    ep_rank: int = 0

    @classmethod
    def current(cls) -> Ranks:
        ps = parallel_state
        return cls(
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            ep=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
        )

    @property
    def holds_whole_model(self) -> bool:
        """This rank's replica and the ``ep - 1`` beside it hold every weight between them
        once: the ranks that speak for the model in gathers (the first expert group)."""
        return in_first_expert_group(self.dp_rank, self.ep)

    def check_expert_numbering(self) -> None:
        """``convert.check_expert_numbering`` against megatron-core's own numbering (two
        lookups); ``init_model_parallel`` runs it once, for the export and checkpoints alike."""
        ps = parallel_state
        check_expert_numbering(
            self.dp_rank,
            self.ep,
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_data_parallel_rank(),
        )

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_model_parallel(cfg: MegatronConfig, layout: GPTLayout) -> Ranks:
    """``initialize_model_parallel`` with the config's sizes; data parallel is what is left."""
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"{world} ranks do not split into tensor_parallel_size {tp} x "
            f"pipeline_parallel_size {pp}"
        )
    check_expert_parallel(
        layout,
        world,
        tp,
        pp,
        cfg.expert_parallel_size,
        cfg.moe_aux_loss_coeff,
        cfg.sequence_parallel,
    )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=cfg.expert_parallel_size,
        )
    ranks = Ranks.current()
    # Here rather than at each use: the weight export and checkpoints both rely on it, and
    # an SFT run that never refits saves checkpoints all the same.
    ranks.check_expert_numbering()
    return ranks


def transformer_config(
    hf: PretrainedConfig, dtype: torch.dtype, cfg: MegatronConfig | None = None
) -> TransformerConfig:
    """Megatron's description of a Llama/Qwen2-family HF config (RMSNorm, SwiGLU, RoPE)."""
    cfg = cfg or MegatronConfig()
    if hf.hidden_act != "silu":
        raise ValueError(f"only SwiGLU (hidden_act='silu') is supported, not {hf.hidden_act!r}")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    rope = getattr(hf, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {rope.get('rope_type')!r} is not supported")
    layout = GPTLayout.from_hf_config(hf)
    return TransformerConfig(
        **_moe_settings(hf, layout, cfg),
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        # Query/key RMS norms over each head (Qwen3): the family's table has their weights.
        qk_layernorm=_has_qk_norms(layout),
        # The shim's no-op RNG fork on CPU relies on there being no dropout.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Every weight is overwritten by the loader (loading.py): drawing Megatron's own
        # random init first would only cost time.
        perform_initialization=False,
        tensor_model_parallel_size=cfg.tensor_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        pipeline_dtype=dtype,
        # Micro-batches differ in rows and length (dynamic lengths, packing): stages tell each
        # other the shape of every activation they send.
        variable_seq_lengths=True,
        # The default ("allgather") refuses variable_seq_lengths; on CPU the shim stands in
        # for the CUDA streams this one uses.
        moe_token_dispatcher_type="alltoall",
        # The schedules must not rescale our losses: they are already global-batch means.
        calculate_per_token_loss=True,
    )


def _has_qk_norms(layout: GPTLayout) -> bool:
    return any("q_layernorm" in w.megatron for w in layout.family.layer)


def _moe_settings(hf: PretrainedConfig, layout: GPTLayout, cfg: MegatronConfig) -> dict:
    """The ``TransformerConfig`` fields of a mixture-of-experts model (none for a dense one)."""
    if not layout.num_experts:
        return {}
    coeff = cfg.moe_aux_loss_coeff
    return dict(
        num_moe_experts=layout.num_experts,
        moe_router_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        expert_model_parallel_size=cfg.expert_parallel_size,
        # HF: softmax over all experts, top k, renormalised when norm_topk_prob; Megatron's
        # default (softmax over the top k logits) is the renormalised form.
        moe_router_pre_softmax=not getattr(hf, "norm_topk_prob", True),
        moe_router_load_balancing_type="aux_loss" if coeff else "none",
        moe_aux_loss_coeff=coeff,
        # No token dropping: every token reaches its k experts, as in HF.
        moe_expert_capacity_factor=None,
        moe_grouped_gemm=False,
    )


class ModelRMSNorm:
    """``torch.nn.RMSNorm`` in the model's dtype, built where Megatron builds a norm.

    The local spec's norm (``WrappedTorchNorm``) is built without a dtype: float32 weights,
    which would round a float64 model's norm weights and update them in float32. It also
    refuses sequence parallelism, only because it cannot tag its weight: a replicated
    parameter that sees part of the sequence on each rank, whose gradient must be summed over
    the tensor-parallel group (``sync_grads`` does so for weights tagged ``sequence_parallel``).
    The layer norms are tagged so under sequence parallelism.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


class QKRMSNorm:
    """``ModelRMSNorm`` for the query/key norms (one weight shared by all heads): each
    tensor-parallel rank applies it to its own heads only, so its gradient is always partial
    and summed over the tensor-parallel group (``sync_grads``), with or without sequence
    parallelism (as Megatron's ``finalize_model_grads`` does for ``qk_layernorm``)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        norm.weight.sum_grad_over_tensor_ranks = True
        return norm


def _layer_spec(hf: PretrainedConfig, cfg: MegatronConfig, pp: int, stage: int):
    layout = GPTLayout.from_hf_config(hf)
    # Experts run one after another (SequentialMLP): the grouped GEMM needs CUDA kernels.
    spec = get_gpt_layer_local_spec(
        num_experts=layout.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=_has_qk_norms(layout),
        normalization="RMSNorm",
    )
    if _has_qk_norms(layout):
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = QKRMSNorm
    spec.submodules.input_layernorm = ModelRMSNorm
    spec.submodules.pre_mlp_layernorm = ModelRMSNorm
    layers = len(stage_layers(hf.num_hidden_layers, pp, stage))
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=ModelRMSNorm)


def build_gpt(hf: PretrainedConfig, dtype: torch.dtype, cfg: MegatronConfig | None = None):
    """This rank's part of the model: its pipeline stage, its tensor-parallel shards.

    Tied embeddings are one parameter when one stage holds both ends. Across stages Megatron
    would allocate the last stage's copy, fill it over the embedding group and move it with
    ``.cuda()`` (no CPU path); here the last stage gets an ordinary output layer instead, loaded
    with the embedding, and ``sync_tied_embedding_grads`` keeps the two equal.
    """
    cfg = cfg or MegatronConfig()
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    ranks = Ranks.current()
    config = transformer_config(hf, dtype, cfg)
    gpt = GPTModel(
        config,
        _layer_spec(hf, cfg, ranks.pp, ranks.pp_rank),
        vocab_size=padded_vocab_size(hf.vocab_size, ranks.tp),
        max_sequence_length=hf.max_position_embeddings,
        pre_process=ranks.first_stage,
        post_process=ranks.last_stage,
        position_embedding_type="rope",
        rotary_base=theta,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings) and ranks.pp == 1,
    )
    tag_tensor_parallel_weights(gpt, config)
    return gpt


def tag_tensor_parallel_weights(gpt: GPTModel, config: TransformerConfig) -> None:
    """Mark each tensor-parallel layer's weight as split over the tensor-parallel ranks.

    Megatron sets these attributes only while it initialises a weight, and ``build_gpt`` asks
    it not to (``perform_initialization=False``: the loader overwrites every weight). Without
    them every weight would look like a tensor-parallel duplicate, and ``clip_grads`` would
    count the gradient norm of the shards on tensor rank 0 only.
    """
    strides = {}
    if config.gated_linear_unit:  # fc1 holds [gate_r; up_r]: Megatron's stride 2
        strides = {id(m.linear_fc1): 2 for m in gpt.modules() if isinstance(m, MLP)}
    for module in gpt.modules():
        if isinstance(module, VocabParallelEmbedding | ColumnParallelLinear):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, strides.get(id(module), 1))


class ShardFiller:
    """Copies pieces into a ``GPTModel`` as the loader emits them (``loading.Emit``), then
    ``check()`` that every weight was given once (``_extra_state`` entries aside)."""

    def __init__(self, gpt: GPTModel) -> None:
        self.targets = {
            k: v for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)
        }  # views of the parameters: copying into them fills the model
        self.filled: set[str] = set()

    @torch.no_grad()
    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        target = self.targets.get(name)
        if target is None:
            raise RuntimeError(f"weights do not fit: this rank's model has no {name!r}")
        if target.shape != tensor.shape:
            raise RuntimeError(
                f"weights do not fit: {name} is {tuple(target.shape)} here, the loader gave "
                f"{tuple(tensor.shape)}"
            )
        target.copy_(tensor)
        self.filled.add(name)

    def check(self) -> None:
        missing = sorted(k for k in set(self.targets) - self.filled if "_extra_state" not in k)
        if missing:
            raise RuntimeError(f"weights do not fit: nothing loaded into {missing[:8]}")


def local_state(gpt: GPTModel) -> dict[str, torch.Tensor]:
    """CPU copies of this rank's weights (``_extra_state`` entries are metadata, not weights)."""
    state = gpt.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def gather_hf_state(
    gpt: GPTModel, layout: GPTLayout, ranks: Ranks, to_all: bool
) -> dict[str, torch.Tensor] | None:
    """The whole model under HF names, from the shards of data-parallel replica 0 (with
    expert parallelism: of the first ``ep`` replicas, each holding its share of the experts).

    A collective over all ranks. ``to_all``: every rank gets the result; otherwise only global
    rank 0 does (the others get None). Shards travel as pickled CPU tensors, so this is for
    checkpoints and models that fit one host, like the DTensor worker's full state dicts.
    """
    mine = None
    if ranks.holds_whole_model:
        state = experts_to_global(local_state(gpt), layout, ranks.ep, ranks.ep_rank)
        mine = (ranks.pp_rank, ranks.tp_rank, state)
    world = dist.get_world_size()
    if to_all:
        shards: list | None = [None] * world
        dist.all_gather_object(shards, mine)
    else:
        shards = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object(mine, shards, dst=0)
    if shards is None:
        return None
    grid: list[list[dict]] = [[{} for _ in range(ranks.tp)] for _ in range(ranks.pp)]
    for shard in shards:
        if shard is not None:  # the expert-parallel ranks' experts merge into one dict
            pp_rank, tp_rank, state = shard
            grid[pp_rank][tp_rank].update(state)
    return megatron_to_hf(unshard_megatron(grid, layout), layout)


# -- gradients ---------------------------------------------------------------------------------


def _all_reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat buffer per dtype."""
    for p in params:
        if p.grad is None:  # e.g. a rank that ran no micro-batch this step
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)


def _tied_copy(gpt: GPTModel, ranks: Ranks, tied: bool) -> torch.nn.Parameter | None:
    """The embedding or its output-layer copy this rank holds, when they live on two stages."""
    if not tied or ranks.pp == 1:
        return None
    if ranks.first_stage:
        return gpt.embedding.word_embeddings.weight
    if ranks.last_stage:
        return gpt.output_layer.weight
    return None


def sync_grads(gpt: GPTModel, ranks: Ranks, tied: bool, sequence_parallel: bool) -> None:
    params = [p for p in gpt.parameters() if p.requires_grad]
    if ranks.tp > 1:
        partial = [
            p
            for p in params
            if (sequence_parallel and getattr(p, "sequence_parallel", False))
            or getattr(p, "sum_grad_over_tensor_ranks", False)
        ]
        if partial:
            _all_reduce_grads(partial, parallel_state.get_tensor_model_parallel_group())
    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    if ranks.dp > 1:
        _all_reduce_grads(dense, parallel_state.get_data_parallel_group())
    if experts and ranks.dp // ranks.ep > 1:
        _all_reduce_grads(experts, parallel_state.get_expert_data_parallel_group())
    copy = _tied_copy(gpt, ranks, tied)
    if copy is not None:
        _all_reduce_grads([copy], parallel_state.get_embedding_group())


def clip_grads(gpt: GPTModel, ranks: Ranks, tied: bool, max_norm: float | None) -> float:
    """The global gradient norm over the whole model (clipped to ``max_norm`` as torch does).

    Each weight counts once: tensor-parallel duplicates (norm weights) only on tensor rank 0,
    a tied embedding only on the first stage. Squares are summed in float64 over the
    model-parallel group (tensor x pipeline ranks of one replica; replicas hold equal grads).
    """
    params = [p for p in gpt.parameters() if p.requires_grad and p.grad is not None]
    copy = _tied_copy(gpt, ranks, tied) if not ranks.first_stage else None
    counted = [p for p in params if param_is_not_tensor_parallel_duplicate(p) and p is not copy]
    device = params[0].grad.device if params else "cpu"
    sq = torch.zeros((), dtype=torch.float64, device=device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in counted:
        (sq if getattr(p, "allreduce", True) else expert_sq).add_(
            p.grad.detach().double().pow(2).sum()
        )
    if ranks.tp * ranks.pp > 1:
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    if ranks.ep > 1 or (expert_sq > 0 and ranks.tp * ranks.pp > 1):
        # Experts differ over the expert-parallel ranks too (and tensor/pipeline ranks).
        group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        dist.all_reduce(expert_sq, group=group)
    norm = float((sq + expert_sq).sqrt())
    if max_norm is not None and math.isfinite(norm):
        # torch.nn.utils.clip_grad_norm_'s rule, so both backends clip alike.
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
    return norm
