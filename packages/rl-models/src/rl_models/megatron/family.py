"""A Megatron model family as one table: which Megatron tensor is made of which HF tensors, how.

A ``ModelFamily`` lists the weights of the Megatron-core ``GPTModel`` (local layer spec: separate
``input_layernorm``/``pre_mlp_layernorm`` modules, not Transformer Engine's layernorm fused into
``linear_qkv``) that stands for a Hugging Face model family. Each ``Weight`` row gives the
Megatron name, the names of the HF tensors it is made of, and a ``Rule``. Everything that moves
weights between the two is derived from the table: conversion both ways
(``convert.hf_to_megatron``/``megatron_to_hf``), cutting and joining tensor-parallel shards
(``convert.shard_megatron``/``unshard_megatron``), the per-rank loading plan
(``loading.shard_plan``) and the weight export (``weight_export``). The families themselves are
in ``rl_models.megatron.families``, one module each.

A rule says two things about a weight:

* how its HF tensors fuse into the Megatron tensor and split back (``fuse``/``split``): one
  tensor as it is; ``QKV``, the attention's q, k and v projections in one ``linear_qkv`` whose
  output rows are grouped per key/value head group ``g``: ``[q heads of group g
  (num_heads / num_kv_heads of them), k_g, v_g]`` for g = 0, 1, ... (weights and biases alike);
  ``GATE_UP``, the gated MLP's gate and up projections stacked as ``[gate; up]`` (Megatron's
  gated linear unit applies the activation to the first half);
* how tensor parallelism over ``tp`` ranks splits it, rank r taking part r (``dim``,
  ``part``/``join``): not at all (``REPLICATED``, the norm weights); along the output rows
  (column parallel: ``QKV``, where the grouping above gives each rank whole key/value groups;
  ``GATE_UP``, where gate and up are each split and rank r holds ``[gate_r; up_r]``; ``VOCAB``,
  which first pads the vocabulary with zero rows to a multiple of tp, rows whose logits the
  model must mask out); or along the input columns (row parallel: ``ROW``).

Mixture-of-experts families add ``experts`` rows: one expert's weights, with ``{e}`` where the
expert's number goes (``EXPERT``). A layer holds them once per expert; under expert parallelism
over ``ep`` ranks, rank r holds experts ``[r * E/ep, (r+1) * E/ep)``, which Megatron numbers
from 0 on each rank (``local_experts.{j}``) while HF keeps the global number.

The two meet in one invariant the loader relies on: rank r's part of a fused tensor is the
fusion, under the rank's own head counts (``GPTLayout.per_rank``), of chunk r of each HF tensor
along ``dim`` (``torch.chunk``), plus the vocabulary's zero rows. So a rank can be filled from
slices of the HF tensors alone. Tensors are only sliced, stacked and reshaped: every conversion
is bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from rl_models.megatron.convert import GPTLayout

#: Where ``GPTModel`` keeps decoder layer ``i``: ``decoder.layers.{i}.``.
MEGATRON_LAYERS = "decoder.layers."
#: Where an ``experts`` row puts the expert's number (Megatron's local one, HF's global one).
EXPERT = "{e}"
#: What precedes the expert's number in a Megatron name (``SequentialMLP``'s module list).
MEGATRON_EXPERTS = "mlp.experts.local_experts."


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (vocab-parallel layers need it)."""
    return -(-vocab_size // tp) * tp


def chunk_bounds(n: int, count: int, index: int) -> tuple[int, int]:
    """The range ``torch.chunk`` gives chunk ``index`` of ``count`` of ``n`` rows."""
    size = -(-n // count)
    start = min(index * size, n)
    return start, min(start + size, n)


@dataclass(frozen=True)
class Rule:
    """A weight made of one HF tensor as it is. ``dim``: the dimension tensor parallelism
    splits, in the HF tensors and the Megatron tensor alike (None: every rank holds it whole)."""

    dim: int | None = None
    #: How many HF tensors the Megatron tensor is made of.
    arity: ClassVar[int] = 1

    def fuse(self, hf: Sequence[torch.Tensor], layout: GPTLayout) -> torch.Tensor:
        (tensor,) = hf
        return tensor

    def split(self, whole: torch.Tensor, layout: GPTLayout) -> tuple[torch.Tensor, ...]:
        """The HF tensors ``fuse`` made ``whole`` of, in the row's order."""
        return (whole,)

    def part(self, whole: torch.Tensor, layout: GPTLayout, tp: int, rank: int) -> torch.Tensor:
        """What tensor-parallel rank ``rank`` holds of the whole (TP=1) tensor."""
        return whole if self.dim is None else whole.chunk(tp, dim=self.dim)[rank]

    def join(self, parts: Sequence[torch.Tensor], layout: GPTLayout) -> torch.Tensor:
        """The whole tensor from every tensor-parallel rank's part, in rank order."""
        return parts[0] if self.dim is None else torch.cat(list(parts), dim=self.dim)

    def pad_rows(self, vocab_size: int, tp: int, rank: int) -> int:
        """Zero rows rank ``rank``'s part has beyond its chunk of the HF tensors."""
        return 0


@dataclass(frozen=True)
class _QKV(Rule):
    arity: ClassVar[int] = 3

    def fuse(self, hf: Sequence[torch.Tensor], layout: GPTLayout) -> torch.Tensor:
        q, k, v = hf
        rest = q.shape[1:]
        g, d = layout.num_kv_heads, layout.head_dim
        parts = (
            q.reshape(g, layout.heads_per_group * d, *rest),
            k.reshape(g, d, *rest),
            v.reshape(g, d, *rest),
        )
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def split(self, whole: torch.Tensor, layout: GPTLayout) -> tuple[torch.Tensor, ...]:
        rest = whole.shape[1:]
        g, d = layout.num_kv_heads, layout.head_dim
        grouped = whole.reshape(g, (layout.heads_per_group + 2) * d, *rest)
        q, k, v = torch.split(grouped, [layout.heads_per_group * d, d, d], dim=1)
        return tuple(t.reshape(-1, *rest) for t in (q, k, v))


@dataclass(frozen=True)
class _GateUp(Rule):
    arity: ClassVar[int] = 2

    def fuse(self, hf: Sequence[torch.Tensor], layout: GPTLayout) -> torch.Tensor:
        return torch.cat(list(hf))

    def split(self, whole: torch.Tensor, layout: GPTLayout) -> tuple[torch.Tensor, ...]:
        return tuple(torch.chunk(whole, 2, dim=0))

    def part(self, whole: torch.Tensor, layout: GPTLayout, tp: int, rank: int) -> torch.Tensor:
        gate, up = whole.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])

    def join(self, parts: Sequence[torch.Tensor], layout: GPTLayout) -> torch.Tensor:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


@dataclass(frozen=True)
class _Vocab(Rule):
    def part(self, whole: torch.Tensor, layout: GPTLayout, tp: int, rank: int) -> torch.Tensor:
        vocab = layout.vocab_size or whole.shape[0]
        pad = padded_vocab_size(vocab, tp) - whole.shape[0]
        if pad:
            whole = torch.cat([whole, whole.new_zeros(pad, *whole.shape[1:])])
        return whole.chunk(tp, dim=0)[rank]

    def join(self, parts: Sequence[torch.Tensor], layout: GPTLayout) -> torch.Tensor:
        whole = torch.cat(list(parts))
        return whole[: layout.vocab_size] if layout.vocab_size else whole

    def pad_rows(self, vocab_size: int, tp: int, rank: int) -> int:
        lo, hi = chunk_bounds(vocab_size, tp, rank)
        return padded_vocab_size(vocab_size, tp) // tp - (hi - lo)


REPLICATED = Rule()
ROW = Rule(dim=1)
QKV = _QKV(dim=0)
GATE_UP = _GateUp(dim=0)
VOCAB = _Vocab(dim=0)


@dataclass(frozen=True)
class Weight:
    """One row of a family's table.

    ``megatron``: the ``GPTModel`` state-dict name (inside a decoder layer: the part after
    ``decoder.layers.{i}.``). ``hf``: the HF tensors it is made of (inside a layer: the part
    after the family's ``hf_layers`` prefix and ``{i}.``), one name or ``rule.arity`` of them.
    ``only_if``: a ``GPTLayout`` flag (e.g. ``"qkv_bias"``) without which the weight is absent.
    """

    megatron: str
    hf: tuple[str, ...] | str
    rule: Rule = REPLICATED
    only_if: str | None = None

    def for_expert(self, local: int, global_: int) -> Weight:
        """The row of one expert: Megatron's local number, HF's global one."""
        return Weight(
            self.megatron.replace(EXPERT, str(local)),
            tuple(n.replace(EXPERT, str(global_)) for n in self.hf),
            self.rule,
            self.only_if,
        )

    def __post_init__(self) -> None:
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))
        if len(self.hf) != self.rule.arity:
            raise ValueError(
                f"{self.megatron}: {type(self.rule).__name__} fuses {self.rule.arity} HF "
                f"tensors, the row names {len(self.hf)}"
            )


@dataclass(frozen=True)
class ModelFamily:
    """The table of one HF model family (see the module docstring).

    ``model_types``: the HF ``config.model_type`` values it stands for. ``layer``: the weights
    of one decoder layer, in the order HF names come out of ``megatron_to_hf``. The embedding,
    final norm and output layer default to the Llama names. ``qkv_bias``: the family's
    attention has q/k/v biases (the ``GPTLayout`` flag of the same name). ``experts``: one
    expert's weights (names with ``EXPERT``), repeated for each expert a rank holds; a family
    with experts is a mixture of experts (``moe``). ``check_config``:
    raises ``ValueError`` for a config the table cannot express (a bias Megatron has no place
    for, say).
    """

    name: str
    model_types: tuple[str, ...]
    layer: tuple[Weight, ...]
    embedding: Weight = Weight(
        "embedding.word_embeddings.weight", "model.embed_tokens.weight", VOCAB
    )
    final_norm: Weight = Weight("decoder.final_layernorm.weight", "model.norm.weight")
    output_layer: Weight = Weight("output_layer.weight", "lm_head.weight", VOCAB)
    #: Where the HF model keeps decoder layer ``i``: ``{hf_layers}{i}.``.
    hf_layers: str = "model.layers."
    #: HF state-dict entries that are no weights (buffers recomputed from the config).
    hf_ignored: tuple[str, ...] = ("rotary_emb.inv_freq",)
    qkv_bias: bool = False
    experts: tuple[Weight, ...] = ()
    #: The HF config attribute that says how many experts a layer has.
    num_experts_key: str = "num_experts"
    check_config: Callable[[Any], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        names = [w.megatron for w in self.layer + self.experts]
        if len(set(names)) != len(names):
            raise ValueError(f"family {self.name!r} names a layer weight twice: {names}")
        for w in self.experts:
            if not w.megatron.startswith(MEGATRON_EXPERTS + EXPERT):
                raise ValueError(f"expert row {w.megatron!r} is not under {MEGATRON_EXPERTS}")

    @property
    def moe(self) -> bool:
        return bool(self.experts)

    def check(self, config: Any) -> None:
        """Refuse an HF config the table cannot express (``ValueError``)."""
        if self.check_config is not None:
            self.check_config(config)

    def layer_weights(self, layout: GPTLayout, ep: int = 1, ep_rank: int = 0) -> tuple[Weight, ...]:
        """The decoder layer's weights present under ``layout`` (``only_if`` flags), with the
        experts expert-parallel rank ``ep_rank`` of ``ep`` holds (all of them at ep=1)."""
        dense = [w for w in self.layer if w.only_if is None or getattr(layout, w.only_if)]
        return (*dense, *self.expert_weights(layout, ep, ep_rank))

    def expert_weights(
        self, layout: GPTLayout, ep: int = 1, ep_rank: int = 0
    ) -> tuple[Weight, ...]:
        """The rows of the experts expert-parallel rank ``ep_rank`` of ``ep`` holds in a layer:
        Megatron's local expert numbers, HF's global ones (none for a dense family)."""
        return tuple(
            w.for_expert(local, global_)
            for local, global_ in enumerate(layout.local_experts(ep, ep_rank))
            for w in self.experts
        )

    def hf_layer(self, i: int) -> str:
        return f"{self.hf_layers}{i}."

    def weight_of(self, megatron_name: str) -> Weight:
        """The row of a ``GPTModel`` state-dict name (any layer number)."""
        if megatron_name.startswith(MEGATRON_LAYERS):
            rest = megatron_name[len(MEGATRON_LAYERS) :].split(".", 1)[1]
            rows: Sequence[Weight] = self.layer
            if rest.startswith(MEGATRON_EXPERTS):
                _, tail = rest[len(MEGATRON_EXPERTS) :].split(".", 1)
                rest, rows = f"{MEGATRON_EXPERTS}{EXPERT}.{tail}", self.experts
        else:
            rest, rows = megatron_name, (self.embedding, self.final_norm, self.output_layer)
        for w in rows:
            if w.megatron == rest:
                return w
        raise KeyError(f"Megatron family {self.name!r} has no weight {megatron_name!r}")
