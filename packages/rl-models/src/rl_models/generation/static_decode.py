"""A lean decoding step for Llama-family models: a preallocated KV cache and fused projections.

Why: a decoding step feeds one token per row through the whole model. For a small model on a
CPU the arithmetic is a few milliseconds; the Hugging Face forward spends more than that on
its own bookkeeping (per-module Python, a fresh 4-D attention mask, a KV cache that grows by
concatenation, separate q/k/v and gate/up matmuls). ``StaticKVDecoder`` runs the same layers as
plain tensor calls over the model's own parameters: the KV cache is written in place into
buffers sized for the whole response, q/k/v and gate/up each run as one matmul of weights
concatenated once per ``sample`` call (so a refit between calls is always seen), and the mask
is a boolean row per sequence.

What it computes: the model's own forward, the same operations in the same dtypes (RMSNorm in
float32, rotary embedding by the model's own ``rotary_emb`` and ``apply_rotary_pos_emb``, the
activation the MLP holds, the attention scale the attention module holds, the softmax in
float32 as the model's eager attention has it), so its logits equal the Hugging Face
forward's up to float rounding (``tests/test_static_decode.py`` checks it against a float64
forward of the whole sequence). In bf16 the roundings differ a little, so a sampled token
may differ where two tokens were within rounding of each other.

Where it applies: ``unsupported_reason`` says None only for the decoder layers it mirrors
(Llama and Qwen2: pre-norm RMSNorm, rotary q/k, grouped-query attention over every earlier
token, a gated MLP; biases wherever the model has them) with no hooks on them. Anything else
(sliding windows, q/k norms, adapters) is decoded by the Hugging Face forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Qwen2's is the same

#: The modules whose forward the decoder mirrors, by class name, per model family.
_MIRRORED = {
    "llama": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "qwen2": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
}


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``StaticKVDecoder`` cannot decode ``model`` (None: it can)."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in _MIRRORED:
        return f"model_type {family!r} is not one of {sorted(_MIRRORED)}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(model, "lm_head", None) is None:
        return "the model has no model.layers or lm_head"
    if model.training:
        return "the model is in training mode (dropout would apply)"
    names = _MIRRORED[family]
    modules = [model, inner, model.lm_head, inner.norm]
    for layer in layers:
        parts = (layer, layer.self_attn, layer.mlp, layer.input_layernorm)
        got = tuple(type(m).__name__ for m in parts)
        if got != names or type(layer.post_attention_layernorm).__name__ != names[3]:
            return f"a decoder layer is built of {got}, not {names}"
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            return "a layer attends through a sliding window"
        attn, mlp = layer.self_attn, layer.mlp
        # Its weights are read as they are: an adapter (LoRA) or a quantised linear in their
        # place would be bypassed.
        for name, linear in (
            ("q_proj", attn.q_proj),
            ("k_proj", attn.k_proj),
            ("v_proj", attn.v_proj),
            ("o_proj", attn.o_proj),
            ("gate_proj", mlp.gate_proj),
            ("up_proj", mlp.up_proj),
            ("down_proj", mlp.down_proj),
        ):
            if type(linear) is not torch.nn.Linear:
                return f"{name} is a {type(linear).__name__}, not a plain torch.nn.Linear"
        modules += [layer, *layer.modules()]
    if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
        return "a module has forward hooks"
    return None


#: The KV cache's first room for new tokens (it doubles when full).
GROWTH_TOKENS = 256


@dataclass
class _Layer:
    """One decoder layer's parameters, q/k/v and gate/up concatenated."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """The linears' biases end to end (zeros for one without), or None if none has one."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat(
        [
            lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
            for lin in linears
        ]
    )


class StaticKVDecoder:
    """Decoding steps of ``model`` (``unsupported_reason(model)`` must be None) from the KV
    cache a prefill of the Hugging Face forward filled, with room for ``new_tokens`` more: a
    ``rl_models.generation.sampling.Decoder``, started by ``prefill``."""

    def __init__(self, model: torch.nn.Module, cache: DynamicCache, new_tokens: int) -> None:
        inner = model.model
        first = inner.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.eps = inner.layers[0].input_layernorm.variance_epsilon
        self.act = inner.layers[0].mlp.act_fn
        self.embed = model.get_input_embeddings()
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                    o=attn.o_proj.weight,
                    o_bias=attn.o_proj.bias,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                    down=mlp.down_proj.weight,
                    down_bias=mlp.down_proj.bias,
                )
            )
        # The prefill's keys and values, then room for the tokens to come, written in place one
        # column a step. Room for GROWTH_TOKENS at first, doubled when full up to the most the
        # response can take: a long max_new_tokens costs memory only if it is used.
        keys = [cache.layers[i].keys for i in range(len(self.layers))]
        values = [cache.layers[i].values for i in range(len(self.layers))]
        batch, _, self.length, _ = keys[0].shape
        self.capacity_limit = self.length + new_tokens
        capacity = min(self.capacity_limit, self.length + GROWTH_TOKENS)
        shape = (len(self.layers), batch, self.kv_heads, capacity, self.head_dim)
        self.keys = keys[0].new_empty(shape)
        self.values = keys[0].new_empty(shape)
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.keys[i, :, :, : self.length] = k
            self.values[i, :, :, : self.length] = v

    @classmethod
    def prefill(
        cls,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        new_tokens: int,
        cache: DynamicCache | None = None,
    ) -> tuple[torch.Tensor, StaticKVDecoder]:
        """The logits ``[B, V]`` at the last position of left-padded prompts, and the decoder of
        up to ``new_tokens`` steps after them. The prompts run through the model's own decoder
        stack (their keys and values go to the decoder's cache), then its output layer on the
        last hidden state only. (Through ``logits_to_keep``, the output layer meets a strided
        ``[B, 1, H]`` slice, which torch multiplies as a batched matmul against ``B`` copies of
        the weight: ~0.4 s for a 50k vocabulary on a CPU, against ~2 ms here.) ``cache``:
        keys and values already computed for tokens before ``input_ids``, which
        ``attention_mask`` covers too."""
        cache = DynamicCache(config=model.config) if cache is None else cache
        hidden = model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        logits = model.lm_head(hidden[:, -1].contiguous())
        # The decoder copies the prefill's keys and values into its own buffers.
        return logits, cls(model, cache, new_tokens)

    def select_rows(self, rows: torch.Tensor) -> None:
        """These rows (indices into the current batch; one may repeat, to copy a shared
        prompt's cache) decode from now on."""
        self.keys = self.keys[:, :, :, : self.length].index_select(1, rows)
        self.values = self.values[:, :, :, : self.length].index_select(1, rows)

    def _make_room(self) -> None:
        """At least one free column in the cache (the cached columns moved to a buffer with
        twice the room, up to the limit)."""
        capacity = self.keys.shape[3]
        if self.length < capacity:
            return
        if capacity >= self.capacity_limit:
            raise RuntimeError(f"the KV cache is full: {capacity} tokens, as many as asked for")
        grown = min(self.capacity_limit, self.length + max(GROWTH_TOKENS, self.length))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:3], grown, old.shape[4]))
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)

    def _norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm, as torch's fused kernel (float32 inside, like the model's;
        it rounds to the model's dtype once, after the scale, where the model's rounds before
        and after it)."""
        return F.rms_norm(h, weight.shape, weight, self.eps)

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, masked: torch.Tensor
    ) -> torch.Tensor:
        """One query per row over its cached keys: ``q [B, H, 1, D]``, ``keys``/``values``
        ``[B, KV, T, D]`` -> ``[B, 1, H * D]``. Written out (two batched matmuls and a float32
        softmax, as the model's eager attention computes it): for a single query, torch's CPU
        flash-attention kernel costs ~1 ms a call, twenty times these three ops."""
        batch, groups = q.shape[0], self.heads // self.kv_heads
        # Query head h reads key/value head h // groups (the model's repeat_kv).
        q = q.reshape(batch, self.kv_heads, groups, self.head_dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scaling  # [B, KV, G, T]
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, values)  # [B, KV, G, D]
        return out.reshape(batch, 1, self.heads * self.head_dim)

    @torch.no_grad()
    def __call__(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[B, V]`` of the next token after ``tokens [B]``: ``attention_mask [B, T]``
        covers every cached token and this one (1: attend), ``positions [B, 1]`` are the
        tokens' positions."""
        batch, column = tokens.shape[0], self.length
        if attention_mask.shape[1] != column + 1:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[1]} tokens; the cache holds "
                f"{column} and this step adds one"
            )
        self._make_room()
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        h = self.embed(tokens[:, None])  # [B, 1, hidden]
        cos, sin = self.rotary(h, positions)
        masked = ~attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]: True = padding
        for i, layer in enumerate(self.layers):
            qkv = F.linear(self._norm(h, layer.input_norm), layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q = q.view(batch, 1, heads, dim).transpose(1, 2)
            k = k.view(batch, 1, kv_heads, dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = self.keys[i, :, :, : column + 1], self.values[i, :, :, : column + 1]
            keys[:, :, column] = k[:, :, 0]
            values[:, :, column] = v.view(batch, kv_heads, dim)
            out = self._attend(q, keys, values, masked)
            h = h + F.linear(out, layer.o, layer.o_bias)
            gate, up = F.linear(
                self._norm(h, layer.post_norm), layer.gate_up, layer.gate_up_bias
            ).chunk(2, dim=-1)
            h = h + F.linear(self.act(gate) * up, layer.down, layer.down_bias)
        self.length += 1
        return self.lm_head(self._norm(h, self.final_norm))[:, 0]
