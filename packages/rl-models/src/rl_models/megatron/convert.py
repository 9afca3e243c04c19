"""Hugging Face weights <-> a Megatron-core ``GPTModel`` state dict, for any registered family.

Pure torch (no megatron import), so conversions are testable wherever torch is. What is
converted, and how, comes from the family's table (``family.py``, ``families/``); this module
walks the table. ``hf_to_megatron``/``megatron_to_hf`` work on whole, unsharded tensors (tensor
and pipeline parallel size 1); ``shard_megatron``/``unshard_megatron`` cut such a state dict into
the pieces each tensor/pipeline-parallel rank holds, and put them back together.

Tied embeddings: Megatron keeps no ``output_layer.weight``; HF gets ``lm_head.weight`` as a copy
of the input embedding.

Pipeline stage s of pp holds decoder layers ``[s * L/pp, (s+1) * L/pp)``, numbered from 0 in its
own state dict; the embedding lives on the first stage and the final norm and output layer on
the last. Tied embeddings with pp > 1 give the last stage its own copy of the embedding as
``output_layer.weight`` (the worker keeps the two equal by summing their grads).

Expert parallelism (mixture-of-experts families): rank r of ep holds experts
``[r * E/ep, (r+1) * E/ep)`` of every layer, numbered from 0 in its state dict
(``shard_megatron``'s ``ep``/``ep_rank``); ``experts_to_global`` renumbers a rank's experts so
that the expert-parallel ranks' state dicts can simply be merged before ``unshard_megatron``.

Tensors are only sliced, stacked and reshaped, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rl_models.megatron.families import family_for
from rl_models.megatron.families.llama import FAMILY as LLAMA
from rl_models.megatron.family import (
    MEGATRON_EXPERTS,
    MEGATRON_LAYERS,
    ModelFamily,
    Weight,
    padded_vocab_size,
)

__all__ = [
    "GPTLayout",
    "check_expert_parallel",
    "experts_to_global",
    "hf_to_megatron",
    "megatron_global_to_hf",
    "megatron_layer_to_hf",
    "megatron_to_hf",
    "padded_vocab_size",
    "shard_megatron",
    "stage_layers",
    "tp_whole",
    "unshard_megatron",
]


@dataclass(frozen=True)
class GPTLayout:
    """The shapes that decide how weights are laid out, and the family whose table names them."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    # The HF vocabulary; tensor parallelism pads it (``padded_vocab_size``) and unsharding
    # drops the padding again. None: take it from the embedding (no padding is ever undone).
    vocab_size: int | None = None
    # The table that names and lays out the weights: ``from_hf_config`` picks it by the
    # config's ``model_type``; a layout made by hand gets Llama's.
    family: ModelFamily = LLAMA
    # Experts per layer (mixture-of-experts families; 0: a dense model).
    num_experts: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} attention heads do not split into "
                f"{self.num_kv_heads} key/value groups"
            )
        if self.family.moe != (self.num_experts > 0):
            raise ValueError(
                f"Megatron family {self.family.name!r} with num_experts={self.num_experts}: "
                "a mixture-of-experts family needs experts, a dense one has none"
            )

    def local_experts(self, ep: int = 1, ep_rank: int = 0) -> range:
        """The global numbers of the experts expert-parallel rank ``ep_rank`` of ``ep`` holds."""
        if self.num_experts % ep:
            raise ValueError(f"{self.num_experts} experts do not split over {ep} ranks")
        per_rank = self.num_experts // ep
        return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check_tp(self, tp: int) -> None:
        if self.num_kv_heads % tp:
            raise ValueError(
                f"{self.num_kv_heads} key/value heads do not split over {tp} tensor-parallel ranks"
            )

    def per_rank(self, tp: int) -> GPTLayout:
        """The head counts one of ``tp`` tensor-parallel ranks holds."""
        self.check_tp(tp)
        return dataclasses.replace(
            self, num_heads=self.num_heads // tp, num_kv_heads=self.num_kv_heads // tp
        )

    @classmethod
    def from_hf_config(cls, config: Any) -> GPTLayout:
        """From a ``transformers`` config (or anything with its attribute names)."""
        family = family_for(config)
        family.check(config)
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias,
            vocab_size=config.vocab_size,
            family=family,
            num_experts=getattr(config, family.num_experts_key) if family.moe else 0,
        )


def check_expert_parallel(
    layout: GPTLayout,
    world: int,
    tp: int,
    pp: int,
    ep: int,
    aux_loss_coeff: float = 0.0,
    sequence_parallel: bool = False,
) -> None:
    """Refuse an expert-parallel size (``megatron.expert_parallel_size``) the model and the
    ranks cannot have, naming the config key (``ValueError``).

    Megatron carves the expert-parallel groups out of the data-parallel ranks (each of the
    ``ep`` ranks of a group is a data-parallel replica for everything but the experts), so
    ``ep`` must divide the data-parallel size ``world / (tp * pp)`` and the number of experts.
    Experts beside tensor parallelism need sequence parallelism (megatron-core refuses them
    otherwise, at the first training step).
    """
    key = "megatron.expert_parallel_size"
    if ep > 1 and not layout.num_experts:
        raise ValueError(
            f"{key}={ep} needs a mixture-of-experts model; {layout.family.name!r} is dense"
        )
    if layout.num_experts % ep:
        raise ValueError(f"{key}={ep} does not divide the model's {layout.num_experts} experts")
    dp = world // (tp * pp)
    if dp % ep:
        raise ValueError(
            f"{key}={ep} must divide the data-parallel size {dp} (world size {world} / "
            f"tensor_parallel_size {tp} / pipeline_parallel_size {pp}): expert groups are "
            "made of data-parallel ranks"
        )
    if layout.num_experts and tp > 1 and not sequence_parallel:
        raise ValueError(
            f"megatron.sequence_parallel must be true for a mixture-of-experts model with "
            f"tensor_parallel_size {tp}: megatron-core trains experts beside tensor "
            "parallelism only with sequence parallelism"
        )
    if aux_loss_coeff and not layout.num_experts:
        raise ValueError(
            f"megatron.moe_aux_loss_coeff={aux_loss_coeff} needs a mixture-of-experts model; "
            f"{layout.family.name!r} is dense"
        )


def in_first_expert_group(dp_rank: int, ep: int) -> bool:
    """Whether data-parallel replica ``dp_rank`` is in the first expert group, whose ``ep``
    replicas hold every weight once between them (later groups are copies of it).

    Megatron numbers expert ranks with the expert-parallel index faster than the
    expert-data-parallel one, so replica ``d`` is expert-parallel rank ``d % ep`` of group
    ``d // ep``: replicas ``0..ep-1`` are the first group, replica ``d`` its rank ``d``. The
    export and the checkpoint gathers rely on this; the worker checks it against megatron-core
    where it sets up its ranks (``check_expert_numbering``).
    """
    return dp_rank < ep


def check_expert_numbering(dp_rank: int, ep: int, expert_rank: int, expert_group: int) -> None:
    """Refuse a rank of the first expert group whose expert-parallel rank and
    expert-data-parallel rank (``expert_group``), as megatron-core numbers them, are not what
    ``in_first_expert_group`` reads off its data-parallel rank: a change in megatron-core's
    numbering then fails at start-up, not as experts exported or saved twice and others
    never."""
    if in_first_expert_group(dp_rank, ep) and (expert_rank, expert_group) != (dp_rank, 0):
        raise RuntimeError(
            f"data-parallel rank {dp_rank} (< expert_parallel_size {ep}) should be "
            f"expert-parallel rank {dp_rank} of expert group 0; megatron-core has it as "
            f"expert-parallel rank {expert_rank} of expert-data-parallel rank {expert_group}"
        )


def _taker(
    state: Mapping[str, torch.Tensor], which: str
) -> tuple[Callable[[str], torch.Tensor], set[str]]:
    """``take(name)``: ``state[name]``, remembered in the returned set of used names."""
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"the {which} state dict has no {name!r}")
        used.add(name)
        return state[name]

    return take, used


def _hf_of(
    w: Weight, whole: torch.Tensor, layout: GPTLayout, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The HF tensors (named ``prefix`` + the row's names) of row ``w``'s whole tensor."""
    return dict(zip((prefix + n for n in w.hf), w.rule.split(whole, layout), strict=True))


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: GPTLayout) -> dict[str, torch.Tensor]:
    """A Megatron ``GPTModel`` state dict (local spec, TP=PP=1) from an HF state dict."""
    fam = layout.family
    src = {k: v for k, v in hf.items() if not k.endswith(fam.hf_ignored)}
    take, used = _taker(src, "Hugging Face")

    def fused(w: Weight, prefix: str = "") -> torch.Tensor:
        return w.rule.fuse([take(prefix + n) for n in w.hf], layout)

    out = {w.megatron: fused(w) for w in (fam.embedding, fam.final_norm)}
    for i in range(layout.num_layers):
        for w in fam.layer_weights(layout):
            out[f"{MEGATRON_LAYERS}{i}.{w.megatron}"] = fused(w, fam.hf_layer(i))
    if layout.tied_embeddings:
        used.update(fam.output_layer.hf)  # HF may list the tied weight under both names
    else:
        out[fam.output_layer.megatron] = fused(fam.output_layer)
    unused = sorted(set(src) - used)
    if unused:
        raise ValueError(f"Hugging Face weights with no Megatron counterpart: {unused[:8]}")
    return out


def megatron_layer_to_hf(
    take: Callable[[str], torch.Tensor],
    i: int,
    layout: GPTLayout,
    weights: Sequence[Weight] | None = None,
) -> dict[str, torch.Tensor]:
    """Decoder layer ``i`` under HF names; ``take(name)`` gives its whole Megatron tensors.

    One layer at a time, so a weight export can convert layer by layer (``megatron_to_hf``
    applies it to every layer). ``weights``: the rows to convert (default: the whole layer,
    every expert under its global number); an expert-parallel rank passes those it holds
    (``ModelFamily.layer_weights``/``expert_weights`` with its ``ep_rank``), whose Megatron
    names carry its local expert numbers and whose HF names the global ones.
    """
    fam = layout.family
    out: dict[str, torch.Tensor] = {}
    for w in fam.layer_weights(layout) if weights is None else weights:
        whole = take(f"{MEGATRON_LAYERS}{i}.{w.megatron}")
        out |= _hf_of(w, whole, layout, fam.hf_layer(i))
    return out


def megatron_global_to_hf(
    name: str, whole: torch.Tensor, layout: GPTLayout
) -> dict[str, torch.Tensor]:
    """The HF tensors of a weight outside the decoder layers (embedding, final norm, output
    layer) from its whole Megatron tensor."""
    return _hf_of(layout.family.weight_of(name), whole, layout)


def megatron_to_hf(meg: Mapping[str, torch.Tensor], layout: GPTLayout) -> dict[str, torch.Tensor]:
    """The HF state dict ``hf_to_megatron`` came from (``lm_head.weight`` always included).

    Megatron's ``_extra_state`` entries (Transformer Engine / fp8 metadata) carry no weights
    and are skipped.
    """
    fam = layout.family
    src = {k: v for k, v in meg.items() if not k.endswith("._extra_state")}
    take, used = _taker(src, "Megatron")
    out: dict[str, torch.Tensor] = {}
    for w in (fam.embedding, fam.final_norm):
        out |= _hf_of(w, take(w.megatron), layout)
    for i in range(layout.num_layers):
        out |= megatron_layer_to_hf(take, i, layout)
    if layout.tied_embeddings:
        used.add(fam.output_layer.megatron)  # present (and equal) when Megatron lists it anyway
        embed = out[fam.embedding.hf[0]]
        out |= dict.fromkeys(fam.output_layer.hf, embed)
    else:
        out |= _hf_of(fam.output_layer, take(fam.output_layer.megatron), layout)
    unused = sorted(set(src) - used)
    if unused:
        raise ValueError(f"Megatron weights with no Hugging Face counterpart: {unused[:8]}")
    return out


# -- tensor and pipeline parallelism ---------------------------------------------------------
#
# How each weight is split over the tensor-parallel ranks is its row's rule (``family.py``).


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The global decoder layer numbers pipeline stage ``stage`` holds (Megatron's even split)."""
    if num_layers % pp:
        raise ValueError(f"{num_layers} layers do not split into {pp} pipeline stages")
    per_stage = num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def tp_whole(name: str, parts: Sequence[torch.Tensor], layout: GPTLayout) -> torch.Tensor:
    """Megatron tensor ``name`` (any stage's numbering) from every tensor-parallel rank's part."""
    return layout.family.weight_of(name).rule.join(parts, layout)


def _renumber_expert(rest: str, offset: int, experts: range | None = None) -> str | None:
    """A layer-relative name with its expert number moved by ``offset`` (None: an expert
    outside ``experts``); other names as they are."""
    if not rest.startswith(MEGATRON_EXPERTS):
        return rest
    number, tail = rest[len(MEGATRON_EXPERTS) :].split(".", 1)
    if experts is not None and int(number) not in experts:
        return None
    return f"{MEGATRON_EXPERTS}{int(number) + offset}.{tail}"


def _to_stage(name: str, layers: range, experts: range | None = None) -> str | None:
    """The name of whole-model weight ``name`` on the stage holding ``layers`` and the
    expert-parallel rank holding ``experts`` (None: absent there)."""
    if name.startswith(MEGATRON_LAYERS):
        index, rest = name[len(MEGATRON_LAYERS) :].split(".", 1)
        if int(index) not in layers:
            return None
        if experts is not None:
            rest = _renumber_expert(rest, -experts.start, experts)
            if rest is None:
                return None
        return f"{MEGATRON_LAYERS}{int(index) - layers.start}.{rest}"
    return name


def experts_to_global(
    state: Mapping[str, torch.Tensor], layout: GPTLayout, ep: int, ep_rank: int
) -> dict[str, torch.Tensor]:
    """Expert-parallel rank ``ep_rank``'s state dict with its experts under their global
    numbers (the inverse of ``shard_megatron``'s renumbering; other weights unchanged)."""
    offset = layout.local_experts(ep, ep_rank).start
    out = {}
    for name, tensor in state.items():
        if name.startswith(MEGATRON_LAYERS):
            index, rest = name[len(MEGATRON_LAYERS) :].split(".", 1)
            name = f"{MEGATRON_LAYERS}{index}.{_renumber_expert(rest, offset)}"
        out[name] = tensor
    return out


def shard_megatron(
    full: Mapping[str, torch.Tensor],
    layout: GPTLayout,
    *,
    tp: int = 1,
    tp_rank: int = 0,
    pp: int = 1,
    pp_rank: int = 0,
    ep: int = 1,
    ep_rank: int = 0,
) -> dict[str, torch.Tensor]:
    """What the rank at ``(tp_rank, pp_rank, ep_rank)`` holds of the whole state dict ``full``.

    ``full`` is what ``hf_to_megatron`` returns. The result has the names of that rank's
    ``GPTModel`` (built with ``pre_process``/``post_process`` for its stage, its experts
    numbered from 0); its tensors are views or fresh copies of ``full``'s, never modified in
    place.
    """
    layout.check_tp(tp)
    fam = layout.family
    layers = stage_layers(layout.num_layers, pp, pp_rank)
    experts = layout.local_experts(ep, ep_rank) if layout.num_experts else None
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = {}
    for name, tensor in full.items():
        if name == fam.embedding.megatron and not first:
            continue
        if name in (fam.final_norm.megatron, fam.output_layer.megatron) and not last:
            continue
        local = _to_stage(name, layers, experts)
        if local is not None:
            out[local] = fam.weight_of(name).rule.part(tensor, layout, tp, tp_rank)
    if layout.tied_embeddings and last and not first:
        embed = full[fam.embedding.megatron]
        out[fam.output_layer.megatron] = fam.embedding.rule.part(embed, layout, tp, tp_rank)
    return out


def unshard_megatron(
    shards: Sequence[Sequence[Mapping[str, torch.Tensor]]], layout: GPTLayout
) -> dict[str, torch.Tensor]:
    """The whole state dict from every rank's shard, ``shards[pp_rank][tp_rank]`` (with
    expert parallelism: the expert-parallel ranks' shards merged, ``experts_to_global``).

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
            copy = tied_copy and name == layout.family.output_layer.megatron
            if name.endswith("._extra_state") or copy:
                continue
            whole = tp_whole(name, [shard[name] for shard in row], layout)
            if name.startswith(MEGATRON_LAYERS):
                index, rest = name[len(MEGATRON_LAYERS) :].split(".", 1)
                name = f"{MEGATRON_LAYERS}{int(index) + offset}.{rest}"
            out[name] = whole
    return out
