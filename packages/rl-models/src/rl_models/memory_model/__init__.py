"""Memory per GPU of a training job, computed from the model's config and the mesh.

What is counted, in bytes per GPU (``P`` parameters, ``L`` layers, ``h`` hidden size, ``I``
MLP width, ``nq``/``nkv`` query/key-value heads of ``d`` dims, ``V`` vocabulary):

- **weights, gradients, optimizer**: ``P`` per GPU times the parameter dtype's bytes, once
  for weights and gradients, ``optimizer_states`` times for the optimizer (AdamW keeps
  ``exp_avg`` and ``exp_avg_sq`` in the parameter dtype: 2). DTensor backend: FSDP2 shards all
  three over every rank (full shard) after tensor parallelism split the layers, so ``P / (tp
  * dp)``. Megatron backend: nothing is sharded over data parallelism (a plain optimizer per
  rank, gradients all-reduced); tensor parallelism splits the layers and vocabulary,
  pipeline parallelism the layers (the heaviest stage counts: its layers, plus embedding and
  output layer when ``pp = 1``, the larger of the two otherwise), expert parallelism the experts.
- **gathered**: FSDP2 all-gathers one unit at a time (a decoder layer, or the root with the
  embedding and output layer) in the compute dtype, and prefetches the next: two units, plus
  one unit's unsharded gradient in the parameter dtype before its reduce-scatter.
- **activations**: what autograd keeps per token and layer, in elements of the compute dtype
  (a float32 value is ``4 / compute_bytes`` of them). ``measure.py`` counts what a forward
  pass saves, layer by layer, and ``tests/test_memory_model.py`` holds the formula to it to the
  byte, on tiny models of both backends in float32 and bfloat16, on one rank (the splits of
  tensor and sequence parallelism are not measured). Rows are padded to the widest
  of their micro-batch, not packed; ``row`` is the widest, ``sequence_length`` (a plan whose
  rows do not fit in one micro-batch is refused).

  * Both backends: the attention and MLP norms' outputs (``2h``) and what the two norms keep.
    transformers' RMSNorm (DTensor) upcasts its input to float32 in any dtype and keeps that
    copy, the float32 inverse RMS and the normalised input in the compute dtype: ``h 4/cb +
    4/cb + h`` each (``cb`` the compute dtype's bytes; ``2h + 1`` in float32, ``3h + 2`` in
    bfloat16). Megatron's (torch's ``RMSNorm``): its input (``h`` each; the rest depends on
    the kernel, below).
  * DTensor (transformers' layers, sdpa): q after RoPE and the attention output (``2 nq d``);
    k and v repeated to every query head (``2 nq d``: transformers repeats them whenever it
    hands sdpa a mask, which padded rows need; a micro-batch of one unpadded row keeps ``2 nkv
    d``, not counted); the kernel's float32 log-sum-exp (``nq``); q and k before their norms
    where the family has them (Qwen3: a norm of ``d`` per query and key/value head, kept
    as the layer's norms are: ``(nq + nkv)(d 4/cb + 4/cb + d)``); and, not split by tensor
    parallelism, the additive bias sdpa makes of the padding mask at every layer, ``[rows,
    row, row]``: ``row`` per token for the widest padded rows (at least two a micro-batch, so
    at most half its tokens each). The SwiGLU MLP: its gate-up output (``2I``), ``silu(gate)``
    and their product (``4I``).
  * Megatron (the local layer spec's ``DotProductAttention`` and ``MLP``,
    ``megatron/parallel.py``): q after RoPE, k and v repeated to every query head and the
    attention output (``4 nq d``; without grouped queries k after RoPE and the fused qkv output
    in place of the repeated k and v); with query/key norms (Qwen3) q before its norm (a copy)
    and the fused qkv output, of which k is a view (``2 nq d + 2 nkv d``); every head's
    scores against its row, ``[rows, nq, row, row]``: the float32 softmax output and, in a
    16-bit compute dtype, its copy for the product with v (``3 nq row`` per token in
    bfloat16), which makes long rows costly; and, not split by tensor parallelism, the rotary
    cos and sin of q and k (``4d`` per position). The MLP's unfused GLU keeps the gate-up
    output, ``silu(gate)``, ``up + glu_linear_offset`` (a new tensor, though the offset is 0)
    and the product (``5I``). Beside the layers, one ``[rows, row, row]`` bool mask per
    micro-batch in flight.
  * A mixture of experts, for each of the ``k`` experts a token visits: its routing weight and
    copy of the token's input (``1 + h``); transformers' experts (DTensor, the default
    ``grouped_mm``) keep the SwiGLU's ``4 I_e`` and their output (``h``), which they multiply
    by the routing weight after the down projection and so keep for that weight's gradient
    (the ``eager`` loop keeps one more ``h``, the ``index_add_`` source); Megatron's
    (``SequentialMLP``: one ``MLP`` each, with ``per_token_scale``) keep the GLU's ``5 I_e``
    and the product scaled by the routing weight before the down projection (``6 I_e``). The
    router: transformers' float32 softmax over the ``E`` experts, its top ``k`` and their sum
    (renormalised, as Qwen3-30B-A3B is; counted always): ``E + k + 1`` float32; Megatron's
    float32 softmax over the top ``k`` logits and the dense ``[tokens, E]`` probabilities its
    dispatcher permutes (``masked_select`` keeps its input): ``k`` float32 and ``E``. A
    partly dense model's layers are averaged. Integer indices and boolean routing maps are
    left out.
  * Tensor parallelism divides the head and MLP terms; sequence parallelism the norms' terms too.
    Context parallelism (DTensor, ``cp`` ranks) splits every row's tokens, so each GPU keeps
    ``1/cp`` of the micro-batch's tokens, but its attention kernel
    (``policy/context_parallel.py``) gathers the whole row's keys and values and repeats them
    to every query head, which sdpa keeps: ``2 nq d`` per token of the row, ``2 nq d cp`` per
    local token; and one ``[local tokens, row tokens]`` mask per micro-batch, a bool and its
    additive bias in the compute dtype (counted for a micro-batch of one row, the largest),
    in place of the padding mask's bias.
  * Beside the layers: the final norm (as a layer's) and its output, which the output layer
    keeps (the embedding's output is the first layer's input, kept by its norm); on DTensor
    transformers' rotary cos and sin, ``[1, row, d]`` each in the compute dtype (the worker
    passes no position ids for padded rows); the int64 token ids (8 bytes a token); and one
    more layer's worth for the gradients of the layer backward is in. With activation
    checkpointing only each layer's input (``h``) is kept, plus the layer being recomputed and
    its gradients (two layers). A Megatron pipeline's first stage keeps ``pp`` micro-batches of
    its ``L / pp`` layers in flight (1F1B): ``L`` layers' worth.
- **logits**: two float32 ``[tokens, V / tp]`` buffers (logits and their softmax/gradient),
  over ``logprob_chunk`` tokens when log-probs are chunked, over the micro-batch otherwise.
- **generator**: vLLM's weights (``P`` in its dtype, over its ``tp``) and KV cache:
  ``2 L nkv d`` bytes-per-element per token (the key/value heads over ``tp``, at least one
  each) for ``sequences x sequence_length`` tokens. The Hugging Face generator
  (``generation/hf_worker.py``, the one that records routed experts for router replay) holds
  the whole model in each worker (``tp`` 1) and decodes its whole share of a batch at once:
  ``sequences`` is the rows one worker gets.
- **refit buffers**: a refit streams the weights in buckets of ``refit_bucket_bytes``; the
  CUDA IPC channel keeps a producer's last two buckets alive (the refit's pipeline depth), and
  the rank packing them holds one whole unit beside them (``policy/weight_export.py``: one
  gathered parameter; ``megatron/weight_export.py``: one layer, embedding or output layer
  gathered from the tensor-parallel ranks), in the parameter dtype.

Phases of a colocated GRPO run (policy and vLLM in two processes on each GPU, taking turns;
the code paths are ``generation/refit.py``, ``generation/vllm/worker.py`` and
``policy/base_worker.py``), each of which must fit:

- *training*: the policy's weights, gradients, optimizer, gathered units, activations and
  logits. vLLM sleeps (level 1: weights in host memory, KV cache released).
- *refit*: the refit moves the optimizer state off the GPU whatever
  ``policy.offload.optimizer_state`` says (the gradients were freed after the optimizer
  step), vLLM wakes its weights only (the KV cache stays released), the buckets flow, then
  the policy's weights go to host memory: the policy's weights, the generator's weights and
  the refit buffers.
- *generation*: the generator's weights and KV cache (vLLM's own activations are in its
  ``OVERHEAD``); of the policy only its process.
- *start*: vLLM starts awake beside a policy that holds its weights, and its startup refuses
  to run unless ``gpu_memory_utilization`` of the GPU is free. The first generation comes
  before any refit (both hold the weights on disk), so nothing has moved the policy; a run
  resumed from a checkpoint also loads its optimizer state onto the GPU now, beside vLLM's
  whole memory. Counted with that state, since any long run may resume: the policy's weights
  and optimizer beside the generator's weights and KV cache. It bounds the usable
  ``gpu_memory_utilization`` from above. (The Hugging Face generator too starts with its
  weights on the GPU, and leaves it only after its first generation.)

A generator on GPUs of its own (``generator_gpus``) shares none with the policy and nothing
is offloaded; each phase peaks on one kind of GPU or the other. ``docs/guides/memory.md``
says what each phase holds then, and why ``policy.offload.optimizer_state`` moves no peak.

Ignored: allocator fragmentation, NCCL buffers, the CUDA context, cuBLAS workspaces and
the generator's own activations: ``OVERHEAD`` per process covers them, and a plan fits when
its peak stays under ``1 - HEADROOM`` of the GPU. Also ignored: norm weights (and Megatron's
MoE routers) split by tensor parallelism (they are replicated; a few MB), what Megatron's
RMSNorms keep beside their inputs (torch's kernel: the inverse RMS and, on the CPU, the
normalised input and float32 copies of a bfloat16 one, which a GPU's kernel need not keep;
``measure.py`` counts them apart), MoE routing indices, Megatron's vocabulary padding (the
embedding and output layer rounded up to a multiple of ``tp`` rows, ``megatron/family.py``), MoE load
imbalance (activations assume each expert rank gets its share of the routed tokens; a rank
whose experts are picked more often keeps more), a reference policy's copy (offloaded to host
between uses), and the forward-only log-prob pass (smaller than a training step).

``python -m rl_models.memory_model NAME`` prints a table (``__main__.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

GIB = 2**30
OVERHEAD = 2 * GIB  # per process: CUDA context, NCCL buffers, cuBLAS workspace, fragmentation
HEADROOM = 0.10  # share of the GPU a plan leaves unused: the allocator never packs perfectly
GPU_BYTES = 80 * 10**9  # an "80 GB" GPU (H100/A100 80GB)


@dataclass(frozen=True)
class Shape:
    """The sizes of a Llama/Qwen2/Qwen3/Qwen3-MoE decoder that memory depends on."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    attention_bias: bool  # q/k/v biases (Qwen2 always; Llama/Qwen3 with attention_bias)
    output_bias: bool  # an o_proj bias (Llama/Qwen3 with attention_bias)
    qk_norm: bool  # Qwen3 families: RMSNorm on each head's q and k
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> Shape:
        """From a transformers config (a ``PretrainedConfig`` or its ``config.json`` dict)."""
        c = dict(config) if isinstance(config, Mapping) else config.to_dict()
        kind = c.get("model_type")
        if kind not in ("llama", "qwen2", "qwen3", "qwen3_moe"):
            raise ValueError(f"model_type {kind!r}: expected llama, qwen2, qwen3 or qwen3_moe")
        if c.get("mlp_bias"):
            raise ValueError("mlp_bias: true is not modelled (no such public model)")
        layers, experts = (
            c["num_hidden_layers"],
            c.get("num_experts", 0) if kind == "qwen3_moe" else 0,
        )
        step, dense_only = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers", []))
        moe_layers = sum(
            1 for i in range(layers) if experts and i not in dense_only and (i + 1) % step == 0
        )
        heads = c["num_attention_heads"]
        bias = bool(c.get("attention_bias", False))
        return cls(
            vocab=c["vocab_size"], hidden=c["hidden_size"], layers=layers, heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate=c["intermediate_size"], tied=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bias or kind == "qwen2", output_bias=bias and kind != "qwen2",
            qk_norm=kind.startswith("qwen3"), experts=experts,
            experts_per_token=c.get("num_experts_per_tok", 0) if experts else 0,
            expert_intermediate=c.get("moe_intermediate_size", 0) if experts else 0,
            moe_layers=moe_layers,
        )  # fmt: skip

    @property
    def attention_params(self) -> int:
        """One layer's attention, with its input norm (and q/k norms)."""
        q, kv, h = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        biases = (q + 2 * kv) * self.attention_bias + h * self.output_bias
        return 2 * h * q + 2 * h * kv + biases + h + 2 * self.head_dim * self.qk_norm

    @property
    def dense_mlp_params(self) -> int:
        """One dense layer's SwiGLU MLP (gate, up, down) with its input norm."""
        return 3 * self.hidden * self.intermediate + self.hidden

    @property
    def expert_params(self) -> int:
        """All experts of one MoE layer."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def moe_mlp_params(self) -> int:
        """One MoE layer's parameters other than its experts: router and norm."""
        return self.experts * self.hidden + self.hidden

    @property
    def vocab_params(self) -> tuple[int, int]:
        """``(embedding, output layer with the final norm)``; a tied output layer adds none."""
        return self.vocab * self.hidden, self.vocab * self.hidden * (not self.tied) + self.hidden

    @property
    def layer_params(self) -> int:
        """Every decoder layer's parameters but the experts."""
        dense = self.layers - self.moe_layers
        mlps = dense * self.dense_mlp_params + self.moe_layers * self.moe_mlp_params
        return self.layers * self.attention_params + mlps

    @property
    def total_params(self) -> int:
        return self.layer_params + self.moe_layers * self.expert_params + sum(self.vocab_params)

    def heaviest_layer(self, ep: int = 1) -> float:
        """The parameters of the largest decoder layer on one rank, its experts over ``ep``."""
        mlps = [self.dense_mlp_params] if self.layers > self.moe_layers else []
        if self.moe_layers:
            mlps.append(self.moe_mlp_params + self.expert_params / ep)
        return self.attention_params + max(mlps)

    @property
    def largest_param(self) -> int:
        """The elements of the largest single parameter in the Hugging Face module: the
        embedding or output layer, a projection, or a MoE layer's fused ``gate_up_proj``
        (``[E, 2 I_e, h]``, the layout transformers builds)."""
        h, q = self.hidden, self.heads * self.head_dim
        candidates = [self.vocab * h, q * h]
        if self.layers > self.moe_layers:
            candidates.append(self.intermediate * h)
        if self.moe_layers:
            candidates.append(self.experts * 2 * self.expert_intermediate * h)
        return max(candidates)

    def activation_elements(self, plan: Plan) -> float:
        """Elements of the compute dtype autograd keeps per (local) token for one whole layer
        under ``plan`` (the module docstring's formula), averaged over the layers of a partly
        dense MoE model. ``measure.py`` measures them (``tests/test_memory_model.py``)."""
        # the two norms' outputs (saved by the projections they feed) and what the norms keep
        residual = 2 * self.hidden / (plan.tp if plan.sequence_parallel else 1)
        dense = (self.layers - self.moe_layers) * self.dense_mlp_elements(plan.backend)
        mlp = (dense + self.moe_layers * self.moe_elements(plan)) / self.layers
        heads = (self.attention_elements(plan) + mlp) / plan.tp
        return residual + self.norm_elements(plan) + heads + self.unsplit_attention_elements(plan)

    def rms_norm_elements(self, width: int, plan: Plan) -> float:
        """What one RMSNorm of ``width`` keeps per token (per head for a query/key norm).
        transformers' norms (DTensor) upcast their input to float32 whatever the compute
        dtype, and keep that float32 input, the float32 inverse RMS and the normalised
        input cast back to the compute dtype: ``width * 4/cb + 4/cb + width`` elements of it
        (in float32 the upcast is the input itself). Megatron's (torch's ``RMSNorm``): its
        input only; what it keeps beside it depends on the kernel (the CPU's composite one
        keeps more than CUDA's fused one), and is left out."""
        if plan.backend == "megatron":
            return width
        f32 = 4 / plan.compute_bytes
        return width * f32 + f32 + width

    def norm_elements(self, plan: Plan) -> float:
        """What the RMSNorms of one layer keep per token (a part of ``activation_elements``):
        the attention and MLP norms (split by sequence parallelism) and the query/key norms
        (split by tensor parallelism)."""
        residual = 2 * self.rms_norm_elements(self.hidden, plan)
        residual /= plan.tp if plan.sequence_parallel else 1
        return residual + self.qk_norm_elements(plan) / plan.tp

    def attention_elements(self, plan: Plan) -> float:
        """Attention's elements per token that tensor parallelism splits (by head)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        f32 = 4 / plan.compute_bytes  # elements of the compute dtype one float32 value takes
        if plan.backend == "dtensor":
            # q after RoPE, the output and the kernel's float32 log-sum-exp per head; k and v
            # repeated to every query head: transformers repeats them when it hands sdpa a
            # mask (padded rows; a micro-batch of one unpadded row keeps only the key/value
            # heads, not counted), context parallelism's kernel always (the whole row's)
            kept = 2 * q + 2 * q * plan.cp + self.heads * f32
        else:
            # Megatron's DotProductAttention: q after RoPE and the output; with grouped queries
            # k and v repeated to every query head, without them k after RoPE and the fused
            # qkv output (v is a view of it)
            grouped = self.heads > self.kv_heads
            kept = 2 * q + (2 * q if grouped else kv + (q + 2 * kv))
            # The scores of each head against its row: the float32 softmax output and, in a
            # 16-bit compute dtype, its copy in that dtype for the product with v.
            kept += self.heads * plan.row_tokens * (f32 + (plan.compute_bytes < 4))
        return kept

    def qk_norm_elements(self, plan: Plan) -> float:
        """What the query/key norms keep per token (Qwen3 families). transformers: one norm
        of ``d`` per query and per key/value head (``rms_norm_elements``). Megatron: q (a
        copy) and, for k, the fused qkv output it is a view of; without grouped queries both
        are views of it, which attention keeps already."""
        if not self.qk_norm:
            return 0
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if plan.backend == "dtensor":
            return (self.heads + self.kv_heads) * self.rms_norm_elements(self.head_dim, plan)
        return (2 * q + 2 * kv) * (self.heads > self.kv_heads)

    def beside_layers_elements(self, plan: Plan) -> float:
        """Floating-point elements autograd keeps per (local) token outside the decoder
        layers: the final norm (``rms_norm_elements``) and its output, which the output layer
        keeps. The embedding's output is the first layer's input, kept by that layer's norm.
        DTensor also keeps transformers' rotary cos and sin, in the compute dtype, computed once
        a micro-batch for a padded micro-batch's positions (``[1, row, d]`` each: the worker
        passes no position ids) and used by every layer; Megatron's are a layer term."""
        final = self.rms_norm_elements(self.hidden, plan) + self.hidden
        final /= plan.tp if plan.sequence_parallel else 1
        if plan.backend == "megatron":
            return final
        return final + 2 * self.head_dim * plan.row_tokens / plan.micro_batch_tokens

    def unsplit_attention_elements(self, plan: Plan) -> float:
        """Attention's elements per token that every tensor-parallel rank keeps whole, each
        layer. Megatron: the rotary cos and sin of q and k (``[positions, head_dim]`` each, for
        a micro-batch of ``micro_batch_tokens / row_tokens`` rows). DTensor: the additive bias
        sdpa makes of transformers' padding mask at each layer (``[rows, row, row]`` in the
        compute dtype), for the widest padded rows: two or more a micro-batch (context
        parallelism's kernel builds its own mask, once per micro-batch: ``breakdown``)."""
        if plan.backend == "megatron":
            return 4 * self.head_dim * plan.row_tokens / plan.micro_batch_tokens
        return 0 if plan.cp > 1 else min(plan.row_tokens, plan.micro_batch_tokens / 2)

    def dense_mlp_elements(self, backend: str = "dtensor") -> int:
        """Elements autograd keeps per token in a dense SwiGLU MLP: the gate and up outputs
        (``2I``, one fused output in Megatron), ``silu(gate)`` and the product that enters the
        down projection; Megatron's unfused GLU also keeps ``up + glu_linear_offset`` (a new
        tensor, though the offset is 0)."""
        return (5 if backend == "megatron" else 4) * self.intermediate

    def moe_elements(self, plan: Plan) -> float:
        """Elements autograd keeps per token in a MoE layer's router and experts."""
        f32 = 4 / plan.compute_bytes
        if plan.backend == "dtensor":
            # the float32 softmax over all experts, the top k and their sum (renormalised)
            router = (self.experts + self.experts_per_token + 1) * f32
        else:
            # the float32 softmax over the top k logits, and the dense [tokens, E]
            # probabilities the dispatcher permutes (masked_select keeps its input)
            router = self.experts_per_token * f32 + self.experts
        return router + self.experts_per_token * self.expert_elements(plan.backend)

    def expert_elements(self, backend: str = "dtensor") -> int:
        """Elements autograd keeps for one token in one expert it is routed to (of the compute
        dtype): its routing weight, its copy of the token's input, and the SwiGLU's tensors.
        transformers (DTensor): the gate-up output (``2 I_e``), ``silu(gate)``, the product,
        and the expert's output, which it multiplies by the routing weight after the down
        projection and so keeps for that weight's gradient. Megatron (``SequentialMLP``, one
        ``MLP`` per expert, ``MLP.forward`` with ``per_token_scale``): the gate-up output,
        ``silu(gate)``, ``up + glu_linear_offset``, the product, and the product scaled by
        the routing weight before the down projection."""
        if backend == "dtensor":
            return 4 * self.expert_intermediate + 2 * self.hidden + 1
        return 6 * self.expert_intermediate + self.hidden + 1

    def kv_bytes_per_token(self, tp: int = 1, kv_bytes: int = 2) -> int:
        """A generator's KV cache per token on one GPU: ``2 L nkv d`` elements, the key/value
        heads split over ``tp`` (each GPU keeping at least one)."""
        return 2 * self.layers * math.ceil(self.kv_heads / tp) * self.head_dim * kv_bytes


@dataclass(frozen=True)
class Plan:
    """How the job runs: the mesh, precision, batch and generator of one training job."""

    backend: Literal["dtensor", "megatron"] = "dtensor"
    gpus: int = 8  # the policy's GPUs
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1  # dtensor.context_parallel_size
    sequence_parallel: bool = False
    param_bytes: int = 4  # policy.model.dtype: float32 master weights (bfloat16: 2)
    compute_bytes: int = 2  # policy.mixed_precision: bfloat16 (none: the param bytes)
    optimizer_states: int = 2  # AdamW's two moments, in the parameter dtype
    # tokens per micro-batch, on each GPU (each of a context-parallel group keeps 1/cp of them)
    micro_batch_tokens: int = 16384
    activation_checkpointing: bool = True
    logprob_chunk: int | None = 1024
    generator: Literal["vllm", "hf"] = "vllm"  # generation.backend
    generator_tp: int = 1  # 0: no generator (SFT)
    generator_gpus: int = 0  # GPUs of the generator's own (colocated: false); 0: the policy's
    generator_bytes: int = 2
    # rows one engine decodes at once: vLLM's generation.vllm.max_num_seqs, the HF generator's
    # share of a batch (rows per step over generation.num_workers)
    sequences: int = 64
    # the longest row, which the generator decodes and the policy trains on:
    # generation.vllm.max_model_len, policy.max_total_sequence_length, SFT's data.max_seq_length
    sequence_length: int = 4096
    kv_bytes: int = 2
    refit_bucket_bytes: int = 256 * 2**20  # generation.refit_bucket_bytes (its default)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def row_tokens(self) -> int:
        """The widest row the policy trains on: the longest sequence (``check`` refuses one
        longer than a micro-batch). Rows are padded to the widest of their micro-batch, not
        packed."""
        return self.sequence_length

    def check(self, shape: Shape) -> None:
        """Refuse a mesh the backends refuse, naming the field."""
        split = self.tp * self.pp * self.cp
        if self.sequence_length > self.micro_batch_tokens:
            # A row is never split across micro-batches: the longest one must fit in one.
            raise ValueError(
                f"sequence_length={self.sequence_length} does not fit in a micro-batch of "
                f"micro_batch_tokens={self.micro_batch_tokens}"
            )
        if self.gpus % split:
            raise ValueError(f"gpus={self.gpus} is not a multiple of tp*pp*cp={split}")
        if self.backend == "dtensor" and (self.pp > 1 or self.ep > 1):
            raise ValueError("the dtensor backend has no pipeline or expert parallelism (pp, ep)")
        if self.backend == "megatron" and self.activation_checkpointing:
            raise ValueError("the megatron backend has no activation_checkpointing")
        if self.cp > 1 and (self.backend != "dtensor" or self.activation_checkpointing):
            # policy/config.py refuses both (context_parallel_rules.context_parallel_clashes)
            raise ValueError("cp > 1 needs the dtensor backend without activation_checkpointing")
        if shape.heads % self.tp or shape.kv_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide {shape.heads}/{shape.kv_heads} heads")
        if self.ep > 1 and (self.dp % self.ep or shape.experts % self.ep):
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} and the experts")
        moe_tp = self.backend == "megatron" and shape.experts and self.tp > 1
        if moe_tp and not self.sequence_parallel:  # megatron/convert.py: check_expert_parallel
            raise ValueError("megatron experts beside tp > 1 need sequence_parallel")
        generator_gpus = self.generator_gpus or self.gpus
        if self.generator_tp and generator_gpus % self.generator_tp:
            raise ValueError(
                f"generator_tp={self.generator_tp} does not divide its {generator_gpus} GPUs"
            )
        if self.generator == "hf" and self.generator_tp > 1:
            raise ValueError(
                "the hf generator holds the whole model in each worker: generator_tp 1"
            )


@dataclass(frozen=True)
class Breakdown:
    """Bytes per GPU of each part and the peak of each phase (the module docstring says how
    each is computed and when each phase holds what)."""

    weights: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float
    logits: float
    generator_weights: float
    kv_cache: float
    refit_buffers: float
    # Not a part: whether the generator has GPUs of its own (the phases then peak on one kind
    # of GPU or the other, each with one process).
    apart: bool = False

    @property
    def has_generator(self) -> bool:
        return bool(self.generator_weights)

    @property
    def colocated(self) -> bool:
        """Whether a generator shares the policy's GPUs (its process adds an ``OVERHEAD``)."""
        return self.has_generator and not self.apart

    @property
    def generator_need(self) -> float:
        """The generator's least memory: its weights, the KV cache the plan's sequences fill,
        and its process's ``OVERHEAD``."""
        return self.generator_weights + self.kv_cache + OVERHEAD * self.has_generator

    @property
    def training(self) -> float:
        parts = self.weights + self.gradients + self.optimizer + self.gathered
        return parts + self.activations + self.logits + OVERHEAD * (1 + self.colocated)

    @property
    def refit(self) -> float:
        if not self.has_generator:
            return 0.0
        if self.apart:  # nothing moves: the policy keeps its optimizer, the generator its KV room
            held = max(self.weights + self.optimizer, self.generator_weights)
            return held + self.refit_buffers + OVERHEAD
        return self.weights + self.generator_weights + self.refit_buffers + 2 * OVERHEAD

    @property
    def generation(self) -> float:
        return OVERHEAD * self.colocated + self.generator_need if self.has_generator else 0.0

    @property
    def start(self) -> float:
        """The generator's start and first generation, or a resumed run's checkpoint load: the
        policy's weights and optimizer state beside the generator's least memory (or, on GPUs
        of its own, the larger of the two)."""
        if not self.has_generator:
            return 0.0
        policy = self.weights + self.optimizer + OVERHEAD
        if self.apart:
            return max(policy, self.generator_need)
        return policy + self.generator_need

    @property
    def peak(self) -> float:
        return max(self.training, self.refit, self.generation, self.start)

    def fits(self, gpu_bytes: float = GPU_BYTES) -> bool:
        return self.peak <= (1 - HEADROOM) * gpu_bytes

    def vllm_memory_utilization(self, gpu_bytes: float = GPU_BYTES) -> tuple[float, float]:
        """``(least, most)`` for ``generation.vllm.gpu_memory_utilization``: enough for vLLM's
        least memory; no more than what the policy leaves at the start (its weights and, on a
        resume, its optimizer state), the phase where vLLM holds the most beside it."""
        beside = self.weights + self.optimizer + OVERHEAD if self.colocated else 0.0
        most = (1 - HEADROOM) * gpu_bytes - beside
        return self.generator_need / gpu_bytes, most / gpu_bytes


def breakdown(shape: Shape, plan: Plan) -> Breakdown:
    """The bytes per GPU of ``shape`` trained as ``plan`` says."""
    plan.check(shape)
    embedding, head = shape.vocab_params
    if plan.backend == "dtensor":
        # FSDP2 shards over the data- and context-parallel ranks as one
        params = shape.total_params / (plan.tp * plan.dp * plan.cp)
        unit = max(shape.heaviest_layer(), embedding + head)
        gathered = unit / plan.tp * (2 * plan.compute_bytes + plan.param_bytes)
        exported = shape.largest_param  # one parameter gathered whole
    else:
        experts = shape.moe_layers * shape.expert_params
        stage = math.ceil(shape.layers / plan.pp) / shape.layers
        vocab = embedding + head if plan.pp == 1 else max(embedding, head)
        params = (stage * (shape.layer_params + experts / plan.ep) + vocab) / plan.tp
        gathered = 0.0
        # one unit gathered whole from the tensor-parallel ranks
        exported = max(shape.heaviest_layer(plan.ep), embedding, head)
    local = plan.micro_batch_tokens / plan.cp  # the tokens one GPU runs
    layer = shape.activation_elements(plan)
    residual = shape.hidden / (plan.tp if plan.sequence_parallel else 1)
    if plan.activation_checkpointing:
        elements = shape.layers * residual + 2 * layer
    else:  # also a pipeline's first stage: pp micro-batches x L/pp layers
        elements = (shape.layers + 1) * layer
    elements += shape.beside_layers_elements(plan)
    # the token ids, int64, which the embedding keeps for its gradient
    activations = (elements * plan.compute_bytes + 8) * local
    if plan.cp > 1:  # the mask of the local tokens against the row's, a bool and its bias
        activations += local * plan.micro_batch_tokens * (1 + plan.compute_bytes)
    if plan.backend == "megatron":  # each micro-batch in flight: its [rows, row, row] bool mask
        activations += plan.pp * plan.micro_batch_tokens * plan.row_tokens
    chunk = min(plan.logprob_chunk or local, local)
    logits = 2 * chunk * shape.vocab / plan.tp * 4
    gen_weights, kv, refit = 0.0, 0.0, 0.0
    if plan.generator_tp:
        gen_weights = shape.total_params * plan.generator_bytes / plan.generator_tp
        tokens = plan.sequences * plan.sequence_length
        kv = tokens * shape.kv_bytes_per_token(plan.generator_tp, plan.kv_bytes)
        refit = 2 * plan.refit_bucket_bytes + exported * plan.param_bytes
    return Breakdown(
        weights=params * plan.param_bytes,
        gradients=params * plan.param_bytes,
        optimizer=params * plan.param_bytes * plan.optimizer_states,
        gathered=gathered,
        activations=activations,
        logits=logits,
        generator_weights=gen_weights,
        kv_cache=kv,
        refit_buffers=refit,
        apart=bool(plan.generator_tp and plan.generator_gpus),
    )


def gib(n: float) -> str:
    """Bytes as GiB, one decimal (the tables' unit)."""
    return f"{n / GIB:.1f}"
