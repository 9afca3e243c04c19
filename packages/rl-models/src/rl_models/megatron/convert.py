"""Hugging Face Llama/Qwen2-family weights <-> a Megatron-core ``GPTModel`` state dict.

Pure torch (no megatron import), so conversions are testable wherever torch is. The Megatron
names are those of the *local* layer spec (``get_gpt_layer_local_spec``: separate
``input_layernorm``/``pre_mlp_layernorm`` modules, not Transformer Engine's layernorm fused
into ``linear_qkv``). ``hf_to_megatron``/``megatron_to_hf`` work on whole, unsharded tensors
(tensor and pipeline parallel size 1); ``shard_megatron``/``unshard_megatron`` cut such a state
dict into the pieces each tensor/pipeline-parallel rank holds, and put them back together.

Layout differences:

* attention: HF has separate ``q_proj``/``k_proj``/``v_proj``; Megatron one ``linear_qkv``
  whose output rows are grouped per key/value head group ``g``:
  ``[q heads of group g (num_heads / num_kv_heads of them), k_g, v_g]`` for g = 0, 1, ...
  (Qwen2's q/k/v biases are fused the same way);
* MLP: HF ``gate_proj``/``up_proj`` are stacked into ``linear_fc1`` as ``[gate; up]``
  (Megatron's gated linear unit applies the activation to the first half);
* tied embeddings: Megatron keeps no ``output_layer.weight``; HF gets ``lm_head.weight`` as
  a copy of the input embedding.

Tensors are only sliced, stacked and reshaped, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: HF modules that hold no weights of their own (buffers recomputed from the config).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class GPTLayout:
    """The shapes that decide how weights are laid out."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    # The HF vocabulary; tensor parallelism pads it (``padded_vocab_size``) and unsharding
    # drops the padding again. None: take it from the embedding (no padding is ever undone).
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} attention heads do not split into "
                f"{self.num_kv_heads} key/value groups"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: Any) -> GPTLayout:
        """From a ``transformers`` config (or anything with its attribute names)."""
        model_type = getattr(config, "model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"no Megatron conversion for model_type {model_type!r}")
        if getattr(config, "mlp_bias", False):
            raise ValueError("MLP biases are not supported")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # Llama's attention_bias also puts a bias on o_proj, which Megatron cannot hold
        # without biases on every linear layer; Qwen2 has q/k/v biases only.
        if model_type == "llama" and getattr(config, "attention_bias", False):
            raise ValueError("Llama attention_bias (o_proj bias) is not supported")
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            vocab_size=config.vocab_size,
        )


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: GPTLayout) -> torch.Tensor:
    """Rows ``[q_g..., k_g, v_g]`` per group; works for weights ``[out, in]`` and biases."""
    rest = q.shape[1:]
    g, d = lay.num_kv_heads, lay.head_dim
    parts = (
        q.reshape(g, lay.heads_per_group * d, *rest),
        k.reshape(g, d, *rest),
        v.reshape(g, d, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, lay: GPTLayout) -> tuple[torch.Tensor, ...]:
    rest = qkv.shape[1:]
    g, d = lay.num_kv_heads, lay.head_dim
    grouped = qkv.reshape(g, (lay.heads_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [lay.heads_per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


def _layer_names(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: GPTLayout) -> dict[str, torch.Tensor]:
    """A Megatron ``GPTModel`` state dict (local spec, TP=PP=1) from an HF state dict."""
    src = {k: v for k, v in hf.items() if not k.endswith(_IGNORED_HF_SUFFIXES)}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise KeyError(f"the Hugging Face state dict has no {name!r}")
        used.add(name)
        return src[name]

    out = {
        "embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": take("model.norm.weight"),
    }
    for i in range(layout.num_layers):
        h, m = _layer_names(i)
        attn, mlp = h + "self_attn.", h + "mlp."
        out[m + "input_layernorm.weight"] = take(h + "input_layernorm.weight")
        out[m + "pre_mlp_layernorm.weight"] = take(h + "post_attention_layernorm.weight")
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            *(take(f"{attn}{p}_proj.weight") for p in "qkv"), layout
        )
        if layout.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                *(take(f"{attn}{p}_proj.bias") for p in "qkv"), layout
            )
        out[m + "self_attention.linear_proj.weight"] = take(attn + "o_proj.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
        )
        out[m + "mlp.linear_fc2.weight"] = take(mlp + "down_proj.weight")
    if layout.tied_embeddings:
        used.add("lm_head.weight")  # HF may list the tied weight under both names
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    unused = sorted(set(src) - used)
    if unused:
        raise ValueError(f"Hugging Face weights with no Megatron counterpart: {unused[:8]}")
    return out


def megatron_layer_to_hf(
    take: Callable[[str], torch.Tensor], i: int, layout: GPTLayout
) -> dict[str, torch.Tensor]:
    """Decoder layer ``i`` under HF names; ``take(name)`` gives its whole Megatron tensors.

    One layer at a time, so a weight export can convert layer by layer (``megatron_to_hf``
    applies it to every layer).
    """
    h, m = _layer_names(i)
    attn, mlp = h + "self_attn.", h + "mlp."
    out = {
        h + "input_layernorm.weight": take(m + "input_layernorm.weight"),
        h + "post_attention_layernorm.weight": take(m + "pre_mlp_layernorm.weight"),
    }
    q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.weight"), layout)
    out |= {attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v}
    if layout.qkv_bias:
        q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.bias"), layout)
        out |= {attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v}
    out[attn + "o_proj.weight"] = take(m + "self_attention.linear_proj.weight")
    gate, up = torch.chunk(take(m + "mlp.linear_fc1.weight"), 2, dim=0)
    out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = gate, up
    out[mlp + "down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
    return out


def megatron_to_hf(meg: Mapping[str, torch.Tensor], layout: GPTLayout) -> dict[str, torch.Tensor]:
    """The HF state dict ``hf_to_megatron`` came from (``lm_head.weight`` always included).

    Megatron's ``_extra_state`` entries (Transformer Engine / fp8 metadata) carry no weights
    and are skipped.
    """
    src = {k: v for k, v in meg.items() if not k.endswith("._extra_state")}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise KeyError(f"the Megatron state dict has no {name!r}")
        used.add(name)
        return src[name]

    embed = take("embedding.word_embeddings.weight")
    out = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": take("decoder.final_layernorm.weight"),
    }
    for i in range(layout.num_layers):
        out |= megatron_layer_to_hf(take, i, layout)
    if layout.tied_embeddings:
        used.add("output_layer.weight")  # present (and equal) when Megatron lists it anyway
        out["lm_head.weight"] = embed
    else:
        out["lm_head.weight"] = take("output_layer.weight")
    unused = sorted(set(src) - used)
    if unused:
        raise ValueError(f"Megatron weights with no Hugging Face counterpart: {unused[:8]}")
    return out


# -- tensor and pipeline parallelism ---------------------------------------------------------
#
# How Megatron's layers split a whole (TP=1) tensor over ``tp`` ranks, rank r taking part r:
#
# * column parallel (output rows split): ``linear_qkv`` weight and bias, ``linear_fc1``, the
#   vocab-parallel ``word_embeddings`` and ``output_layer``. The per-group QKV rows above make
#   a plain split of ``linear_qkv`` give each rank whole key/value groups (num_kv_heads must
#   divide by tp). ``linear_fc1`` is ``[gate; up]`` on every rank, so gate and up are each split
#   and rank r holds ``[gate_r; up_r]``. The vocabulary is first padded with zero rows to a
#   multiple of tp (the model's logits of those rows must be masked out: they are not tokens).
# * row parallel (input columns split): ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj).
# * everything else (the RMSNorm weights) is replicated.
#
# Pipeline stage s of pp holds decoder layers ``[s * L/pp, (s+1) * L/pp)``, numbered from 0 in
# its own state dict; the embedding lives on the first stage and the final norm and output
# layer on the last. Tied embeddings with pp > 1 give the last stage its own copy of the
# embedding as ``output_layer.weight`` (the worker keeps the two equal by summing their grads).

_COLUMN_PARALLEL = (".linear_qkv.weight", ".linear_qkv.bias")
_ROW_PARALLEL = (".linear_proj.weight", ".linear_fc2.weight")
_VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (vocab-parallel layers need it)."""
    return -(-vocab_size // tp) * tp


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The global decoder layer numbers pipeline stage ``stage`` holds (Megatron's even split)."""
    if num_layers % pp:
        raise ValueError(f"{num_layers} layers do not split into {pp} pipeline stages")
    per_stage = num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def _check_tp(layout: GPTLayout, tp: int) -> None:
    if layout.num_kv_heads % tp:
        raise ValueError(
            f"{layout.num_kv_heads} key/value heads do not split over {tp} tensor-parallel ranks"
        )


def _tp_part(name: str, tensor: torch.Tensor, layout: GPTLayout, tp: int, rank: int):
    if name.endswith(_VOCAB_PARALLEL):
        vocab = layout.vocab_size or tensor.shape[0]
        pad = padded_vocab_size(vocab, tp) - tensor.shape[0]
        if pad:
            tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
        return tensor.chunk(tp, dim=0)[rank]
    if name.endswith(_COLUMN_PARALLEL):
        return tensor.chunk(tp, dim=0)[rank]
    if name.endswith(".linear_fc1.weight"):
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if name.endswith(_ROW_PARALLEL):
        return tensor.chunk(tp, dim=1)[rank]
    return tensor


def _tp_whole(name: str, parts: list[torch.Tensor], layout: GPTLayout) -> torch.Tensor:
    if name.endswith(_VOCAB_PARALLEL):
        whole = torch.cat(parts)
        return whole[: layout.vocab_size] if layout.vocab_size else whole
    if name.endswith(_COLUMN_PARALLEL):
        return torch.cat(parts)
    if name.endswith(".linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if name.endswith(_ROW_PARALLEL):
        return torch.cat(parts, dim=1)
    return parts[0]


def _to_stage(name: str, layers: range) -> str | None:
    """The name of whole-model weight ``name`` on the stage holding ``layers`` (None: absent)."""
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers.") :].split(".", 1)
        if int(index) not in layers:
            return None
        return f"decoder.layers.{int(index) - layers.start}.{rest}"
    return name


def shard_megatron(
    full: Mapping[str, torch.Tensor],
    layout: GPTLayout,
    *,
    tp: int = 1,
    tp_rank: int = 0,
    pp: int = 1,
    pp_rank: int = 0,
) -> dict[str, torch.Tensor]:
    """What the rank at ``(tp_rank, pp_rank)`` holds of the whole state dict ``full``.

    ``full`` is what ``hf_to_megatron`` returns. The result has the names of that rank's
    ``GPTModel`` (built with ``pre_process``/``post_process`` for its stage); its tensors are
    views or fresh copies of ``full``'s, never modified in place.
    """
    _check_tp(layout, tp)
    layers = stage_layers(layout.num_layers, pp, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = {}
    for name, tensor in full.items():
        if name.startswith("embedding.") and not first:
            continue
        if name.startswith(("decoder.final_layernorm.", "output_layer.")) and not last:
            continue
        local = _to_stage(name, layers)
        if local is not None:
            out[local] = _tp_part(name, tensor, layout, tp, tp_rank)
    if layout.tied_embeddings and last and not first:
        out["output_layer.weight"] = _tp_part(
            "embedding.word_embeddings.weight",
            full["embedding.word_embeddings.weight"],
            layout,
            tp,
            tp_rank,
        )
    return out


def unshard_megatron(
    shards: Sequence[Sequence[Mapping[str, torch.Tensor]]], layout: GPTLayout
) -> dict[str, torch.Tensor]:
    """The whole state dict from every rank's shard, ``shards[pp_rank][tp_rank]``.

    The inverse of ``shard_megatron`` (bit-exact: only concatenation and slicing). With tied
    embeddings the last stage's ``output_layer.weight`` copy is dropped; the first stage's
    embedding is the weight.
    """
    pp, tp = len(shards), len(shards[0])
    out: dict[str, torch.Tensor] = {}
    for stage, row in enumerate(shards):
        if len(row) != tp:
            raise ValueError("every pipeline stage needs one shard per tensor-parallel rank")
        offset = stage_layers(layout.num_layers, pp, stage).start
        tied_copy = layout.tied_embeddings and stage > 0
        for name in row[0]:
            if name.endswith("._extra_state") or (tied_copy and name == "output_layer.weight"):
                continue
            whole = _tp_whole(name, [shard[name] for shard in row], layout)
            if name.startswith("decoder.layers."):
                index, rest = name[len("decoder.layers.") :].split(".", 1)
                name = f"decoder.layers.{int(index) + offset}.{rest}"
            out[name] = whole
    return out
