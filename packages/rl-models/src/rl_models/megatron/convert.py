"""Hugging Face Llama/Qwen2-family weights <-> a Megatron-core ``GPTModel`` state dict.

Pure torch (no megatron import), so conversions are testable wherever torch is. The Megatron
names are those of the *local* layer spec (``get_gpt_layer_local_spec``: separate
``input_layernorm``/``pre_mlp_layernorm`` modules, not Transformer Engine's layernorm fused
into ``linear_qkv``), with tensor and pipeline parallel size 1: whole, unsharded tensors.

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

from collections.abc import Mapping
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
        h, m = _layer_names(i)
        attn, mlp = h + "self_attn.", h + "mlp."
        out[h + "input_layernorm.weight"] = take(m + "input_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = take(m + "pre_mlp_layernorm.weight")
        q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.weight"), layout)
        out |= {attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v}
        if layout.qkv_bias:
            q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.bias"), layout)
            out |= {attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v}
        out[attn + "o_proj.weight"] = take(m + "self_attention.linear_proj.weight")
        gate, up = torch.chunk(take(m + "mlp.linear_fc1.weight"), 2, dim=0)
        out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = gate, up
        out[mlp + "down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
    if layout.tied_embeddings:
        used.add("output_layer.weight")  # present (and equal) when Megatron lists it anyway
        out["lm_head.weight"] = embed
    else:
        out["lm_head.weight"] = take("output_layer.weight")
    unused = sorted(set(src) - used)
    if unused:
        raise ValueError(f"Megatron weights with no Hugging Face counterpart: {unused[:8]}")
    return out
