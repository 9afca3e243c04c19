"""Forward passes of a Hugging Face model over one micro-batch, padded or packed.

Five outputs, all in the row order and right padding of the micro-batch:

- ``forward_logprobs``: ``[B, S]`` next-token log-probs, 0 at position 0 and on padding (with
  ``gather_ids`` ``[B, S, k]``: ``[B, S, 1 + k]``, the input token's and those k tokens'
  log-probs, for distillation over a teacher's top-k; with ``entropy``: ``[B, S, 2]``, the
  log-probs and each distribution's entropy, for an entropy bonus);
- ``forward_topk_logprobs``: ``[B, S, k]`` top-k log-probs and their token ids, aligned the
  same way (a distillation teacher's report);
- ``forward_logits``: ``[B, S, V]`` next-token logits aligned the same way (``[:, t]`` is the
  distribution that predicts token ``t``), for losses over the whole vocabulary;
- ``forward_scores``: ``[B, num_labels]`` sequence-classifier (reward model) scores read at
  each sequence's last real token;
- ``forward_state_values``: ``[B, S]`` a value model's (critic's) output at every position:
  ``[:, t]`` is the value of the state after tokens ``0..t``.

The ``Output`` objects at the end wrap them as what a worker asks for: one object per kind of
output, which knows the model kind that has it; ``LOSS_OUTPUTS`` gives the one for each
``LossInput`` a loss may declare.

Packed micro-batches (``ForwardOptions.packed``) put all sequences in one row with positions
restarting at 0 per sequence. How the sequences are kept apart depends on the attention kernel:
sdpa and eager get a dense block-diagonal causal mask; the flash-attention and flex kernels get
no mask at all and find the sequence boundaries from the position ids (Hugging Face's
packed-sequence path: variable-length kernels, no ``[T, T]`` mask in memory).

Under context parallelism (``ForwardOptions.context``) each rank runs the model on its share
of every row, padded or packed (``context_parallel.py``); the per-token outputs are gathered
back to whole rows before anything above reads them, so they are the same on every rank.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.packing import PackedSequences, pack_sequences, unpack_sequences
from rl_models.interfaces import (
    GatheredLogprobs,
    Logits,
    Logprobs,
    LossInput,
    LossTokenLogprobs,
    LossTokenLogprobsAndEntropy,
    Scores,
    Values,
)
from rl_models.modeling.moe_routes import NO_ROUTE, RouteReplay
from rl_models.policy import context_parallel
from rl_models.policy.config import PolicyConfig
from rl_models.policy.context_parallel import ContextGroup, ContextSplit, NoSplit
from rl_models.policy.logprobs import (
    logsumexp_and_entropy,
    output_layer_computes_logprobs,
    output_layer_computes_topk,
    scaled_logits,
    supports_chunked_logprobs,
)
from rl_models.policy.shared_prefix import (
    shared_prefix_logprobs,
    sharing_pays,
    supports_shared_prefix,
)

DENSE_MASK_KERNELS = ("sdpa", "eager")


@dataclass(frozen=True)
class ForwardOptions:
    """How a policy runs its forward passes: what its ``PolicyConfig`` says, read once."""

    packed: bool = False  # sequence_packing.enabled: one packed row per micro-batch
    attn_implementation: str = "sdpa"  # model.attn_implementation
    chunk_size: int | None = None  # logprob_chunk_size: tokens per output-layer chunk
    temperature: float = 1.0  # logprob_temperature
    # share_prompt_prefix (shared_prefix.py), off with router_replay or tensor parallelism
    share_prefix: bool = False
    router_replay: bool = False  # router_replay: MoE routers replay the batch's routed_experts
    # The output layer is split over the vocabulary (tensor parallel): log-probs always come
    # from its slices (logprobs.vocab_parallel_logprobs), never from whole logits.
    vocab_parallel: bool = False
    # Context parallelism (context_parallel.py): this rank runs its share of every row. Not in
    # the config: the worker sets it once its process groups exist.
    context: ContextGroup | None = None

    @classmethod
    def of(cls, config: PolicyConfig) -> ForwardOptions:
        _, tp = config.model_parallel_layout
        return cls(
            packed=config.sequence_packing.enabled,
            attn_implementation=config.model.attn_implementation,
            chunk_size=config.logprob_chunk_size,
            temperature=config.logprob_temperature,
            # The shared-prefix forward runs a group's prompt once and its rows' tails apart:
            # the routes of a replayed batch would have to be cut the same way. It also runs
            # the model's pieces itself, outside the tensor-parallel plan's hooks, and over
            # whole rows, not context-parallel shares of them.
            share_prefix=config.share_prompt_prefix
            and not config.router_replay
            and tp == 1
            and config.context_parallel_size == 1,
            router_replay=config.router_replay,
            vocab_parallel=tp > 1,
        )


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(targets) under ``softmax(logits / temperature)``; half precisions are upcast.
    ``targets`` is ``logits``' shape without its last dimension, or with k in its place."""
    logp = _log_softmax(logits, temperature)
    if targets.dim() == logits.dim():
        return logp.gather(-1, targets)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``[..., 2]``: ``token_logprobs`` of one target per position, then the entropy ``-sum_v
    p_v log p_v`` of the position's whole distribution (what ``chunked_logprobs`` gives with
    ``entropy``, for output layers it cannot replace; autograd's gradients)."""
    z = scaled_logits(logits, temperature)
    lse, entropy = logsumexp_and_entropy(z)
    return torch.cat([z.gather(-1, targets.unsqueeze(-1)) - lse, entropy], -1)


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(scaled_logits(logits, temperature), dim=-1)


def _padding_mask(mb: BatchedDataDict) -> torch.Tensor:
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    pos = torch.arange(ids.shape[1], device=ids.device)
    return pos[None, :] < lengths[:, None].to(ids.device)


def _packed_documents(packed: PackedSequences, rows: int) -> torch.Tensor:
    """``[T]``: the sequence (row of the micro-batch) each token of the packed row came from."""
    device = packed.input_ids.device
    slots = packed.cu_seqlens.diff().long().to(device)
    return torch.repeat_interleave(torch.arange(rows, device=device), slots)


def _packed_inputs(
    mb: BatchedDataDict, attn_implementation: str
) -> tuple[PackedSequences, dict[str, torch.Tensor | None]]:
    """One packed row and the model arguments that keep its sequences apart."""
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    p = pack_sequences(ids, lengths)
    mask = None
    if attn_implementation in DENSE_MASK_KERNELS:
        # A token sees earlier tokens of its own sequence only.
        seq = _packed_documents(p, ids.shape[0])
        causal = torch.ones(seq.numel(), seq.numel(), dtype=torch.bool, device=ids.device).tril()
        mask = (causal & (seq[:, None] == seq[None, :]))[None, None]
        if attn_implementation == "eager":
            # Eager attention adds a 4-D mask to the scores (sdpa takes booleans as given).
            mask = torch.zeros(mask.shape, device=ids.device).masked_fill(~mask, float("-inf"))
    # No KV cache: with one, Hugging Face skips its packed-sequence detection.
    inputs = {"input_ids": p.input_ids, "position_ids": p.position_ids, "attention_mask": mask}
    return p, {**inputs, "use_cache": False}


def _model_inputs(
    mb: BatchedDataDict, options: ForwardOptions
) -> tuple[PackedSequences | None, dict[str, torch.Tensor | bool | None]]:
    """The model's arguments for ``mb``: its padded rows, or one packed row (with its
    ``PackedSequences``)."""
    if options.packed:
        # Under context parallelism the kernel builds its own mask (no [T, T] one here).
        kernel = context_parallel.NAME if options.context else options.attn_implementation
        return _packed_inputs(mb, kernel)
    real = _padding_mask(mb).long()
    return None, {"input_ids": mb["input_ids"], "attention_mask": real, "use_cache": False}


def _split(
    inputs: dict[str, torch.Tensor | bool | None],
    mb: BatchedDataDict,
    packed: PackedSequences | None,
    options: ForwardOptions,
) -> ContextSplit | NoSplit:
    """The model's ``inputs`` as this rank runs them: its share of every row under context
    parallelism (the documents a token may attend within: its padded row, or its sequence of
    the packed row; padding none), else whole."""
    if options.context is None:
        return NoSplit(inputs)
    if packed is None:
        documents = torch.where(_padding_mask(mb), 0, -1)
    else:
        documents = _packed_documents(packed, mb["input_ids"].shape[0])[None]
    return options.context.split(inputs, documents)


def _run(model: torch.nn.Module, split: ContextSplit | NoSplit) -> torch.Tensor:
    """The model's ``logits`` output over this rank's tokens (not gathered)."""
    with split.attending(model):
        return model(**split.inputs).logits


def routes_replayed(
    model: torch.nn.Module, mb: BatchedDataDict, options: ForwardOptions
) -> contextlib.AbstractContextManager:
    """Where ``options.router_replay``: the block inside which the model's MoE routers replay
    the micro-batch's ``routed_experts`` (packed like its tokens when the forward packs them);
    else nothing. The block should span the backward too when activations are recomputed."""
    if not options.router_replay:
        return contextlib.nullcontext()
    if "routed_experts" not in mb:
        raise KeyError(
            "policy.router_replay is on but the batch has no 'routed_experts' (the generator "
            "records them with generation.record_routed_experts: true)"
        )
    routes = mb["routed_experts"]
    if options.packed:
        routes = pack_sequences(routes, mb["input_lengths"], pad_value=NO_ROUTE).input_ids
    return RouteReplay(model, routes)


def forward_logprobs(
    model: torch.nn.Module,
    mb: BatchedDataDict,
    options: ForwardOptions,
    wanted: torch.Tensor | None = None,
    gather_ids: torch.Tensor | None = None,
    entropy: bool = False,
) -> torch.Tensor:
    """``[B, S]`` next-token log-probs of one micro-batch (0 at position 0 and on padding),
    under the temperature-scaled distribution (``options.temperature``).

    ``entropy``: the result is ``[B, S, 2]``, ``[..., 0]`` the log-probs, ``[..., 1]`` the
    entropy of the whole distribution that predicts each token (aligned and zeroed alike),
    from the same chunks of logits; not with ``gather_ids``.

    ``gather_ids``: ``[B, S, k]`` token ids aligned like the output (``[:, t]`` are tokens the
    distribution predicting token ``t`` is asked about, e.g. a teacher's top-k there); the
    result is then ``[B, S, 1 + k]``: ``[..., 0]`` the input token's log-prob as without
    ``gather_ids``, ``[..., 1:]`` those k tokens' log-probs (0 at position 0 and on padding).

    ``options.chunk_size``: the output layer computes the log-probs that many tokens at a time
    inside the model's forward (``logprobs.py``), so no ``[tokens, vocab]`` logits exist at
    once. ``wanted``: ``[B, S]`` bool, the positions whose log-prob is needed (a loss's
    tokens); the others are 0 and, with a chunkable output layer, never reach it (for a GRPO
    batch that is the whole prompt: most of the output layer's and the log-softmax's work).
    ``options.share_prefix``: rows of a padded micro-batch that start with the same tokens
    before their first wanted one (a GRPO group's prompt) run those tokens once
    (``shared_prefix.py``).
    """
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    chunk_size, temperature = options.chunk_size, options.temperature
    if entropy and gather_ids is not None:
        raise ValueError("forward_logprobs gives the entropy with one token per position only")
    # The output layer computes log-probs itself only where its output is the plain logits.
    in_head = supports_chunked_logprobs(model) and (
        chunk_size is not None
        or wanted is not None
        or entropy
        or options.vocab_parallel
        or options.context is not None
    )
    wanted = wanted if in_head else None
    # Per position, the tokens whose log-probs are wanted: the input token, then gather_ids.
    tokens = ids if gather_ids is None else torch.cat([ids[..., None], gather_ids.to(ids)], -1)
    # The shared-prefix pass gives one token's log-prob per position (and its entropy).
    sharing = options.share_prefix and not options.packed and gather_ids is None
    if sharing and wanted is not None:
        wanted = wanted & _padding_mask(mb)
        if supports_shared_prefix(model, options.attn_implementation) and sharing_pays(
            model, wanted, lengths, ids
        ):
            return shared_prefix_logprobs(model, mb, wanted, chunk_size, temperature, entropy)
    p, inputs = _model_inputs(mb, options)
    split = _split(inputs, mb, p, options)
    row_tokens, row_wanted = tokens, wanted
    if p is not None:  # the one packed row's
        row_tokens = pack_sequences(tokens, lengths).input_ids
        row_wanted = None if wanted is None else pack_sequences(wanted, lengths).input_ids
    # Position t's output is log p(token t+1); the last position has no next token.
    keep = None if row_wanted is None else F.pad(row_wanted[:, 1:].bool(), (0, 1))
    trailing = (0, 0) * (tokens.dim() - 2)  # F.pad widths that leave a k dimension alone
    if in_head:
        # The output layer's forward is swapped for the chunked log-probs while the model runs
        # (not called on hidden states taken out of it): FSDP2's and peft's hooks then see one
        # ordinary call, and the output layer's sharded weight is gathered as usual.
        # Targets (and kept positions) of the whole rows, split like the tokens: a token's
        # target may be held by the next rank.
        targets = split.local(F.pad(row_tokens[:, 1:], (*trailing, 0, 1)))
        keep = None if keep is None else split.local(keep)
        with output_layer_computes_logprobs(model, targets, chunk_size, temperature, keep, entropy):
            lp = split.gathered(_run(model, split))[:, :-1]
    elif entropy:
        logits = split.gathered(_run(model, split))[:, :-1]
        lp = token_logprobs_and_entropy(logits, row_tokens[:, 1:], temperature)
    else:
        logits = split.gathered(_run(model, split))[:, :-1]
        lp = token_logprobs(logits, row_tokens[:, 1:], temperature)
    return _aligned(F.pad(lp, (*(0, 0) * (lp.dim() - 2), 1, 0)), mb, p)


def _aligned(
    out: torch.Tensor, mb: BatchedDataDict, packed: PackedSequences | None
) -> torch.Tensor:
    """Per-position values already shifted so that ``[:, t]`` belongs to token ``t`` (of the
    padded ``[B, S, ...]`` rows, or of the one ``packed`` row): 0 at each sequence's first
    token and on padding, in the micro-batch's padded layout."""
    if packed is None:
        real = _padding_mask(mb)
        return out * real.view(*real.shape, *[1] * (out.dim() - 2))
    first = packed.position_ids[0] > 0  # a sequence's first token has nothing predicting it
    out = out[0] * first.view(-1, *[1] * (out.dim() - 2))
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    return unpack_sequences(out[None], packed.cu_seqlens, lengths, ids.shape[1])


def forward_topk_logprobs(
    model: torch.nn.Module, mb: BatchedDataDict, options: ForwardOptions, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely next tokens of every position: log-probs ``[B, S, k]`` (under the
    temperature-scaled distribution, descending) and their ids ``[B, S, k]`` (int64), aligned
    like ``forward_logprobs`` (``[:, t]`` is the distribution that predicts token ``t``; both
    are 0 at position 0 and on padding). With a chunkable output layer no ``[tokens, vocab]``
    logits exist: the output layer computes the top-k ``chunk_size`` tokens at a time."""
    p, inputs = _model_inputs(mb, options)
    split = _split(inputs, mb, p, options)
    chunk_size, temperature = options.chunk_size, options.temperature
    if supports_chunked_logprobs(model):
        with output_layer_computes_topk(model, k, chunk_size, temperature) as found:
            values = _run(model, split)
        top_ids = found["ids"]
    else:  # soft-capped or scaled logits: the model's own, whole
        values, top_ids = _log_softmax(_run(model, split), temperature).topk(k, dim=-1)
    values, top_ids = split.gathered(values), split.gathered(top_ids)
    values, top_ids = (_aligned(F.pad(t[:, :-1], (0, 0, 1, 0)), mb, p) for t in (values, top_ids))
    return values, top_ids


def forward_logits(
    model: torch.nn.Module, mb: BatchedDataDict, options: ForwardOptions
) -> torch.Tensor:
    """``[B, S, V]`` next-token logits; ``[:, t]`` predicts token ``t`` (0 at t=0 and padding).

    Under tensor parallelism the vocabulary slices are gathered: a loss over whole logits
    gets them whole on every rank (its backward hands each rank its own slice's gradient).
    They are made whole before context parallelism's gather, which takes plain tensors."""
    p, inputs = _model_inputs(mb, options)
    split = _split(inputs, mb, p, options)
    logits = _run(model, split)
    if options.vocab_parallel:
        logits = logits.full_tensor()
    logits = split.gathered(logits)
    return _aligned(F.pad(logits[:, :-1], (0, 0, 1, 0)), mb, p)


def forward_state_values(
    model: torch.nn.Module, mb: BatchedDataDict, options: ForwardOptions
) -> torch.Tensor:
    """``[B, S]`` the value head's output at every position (0 on padding), unshifted: position
    ``t`` values the state that has seen tokens ``0..t`` (see ``align_values``)."""
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    p, inputs = _model_inputs(mb, options)
    out = model(**inputs).logits[..., 0]
    if p is None:
        return out * _padding_mask(mb)
    return unpack_sequences(out, p.cu_seqlens, lengths, ids.shape[1])


def align_values(state_values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """State values shifted to the tokens they choose, like log-probs: ``[:, t]`` is the value
    of the state that chose token ``t`` (the output at ``t - 1``), 0 at position 0 and on
    padding."""
    pos = torch.arange(state_values.shape[1], device=state_values.device)
    real = pos[None, :] < lengths.to(state_values.device)[:, None]
    return F.pad(state_values[:, :-1], (1, 0)) * real


@contextlib.contextmanager
def _score_head_picks(model: PreTrainedModel, rows: torch.Tensor) -> Iterator[None]:
    """While inside, the model's ``score`` head scores only the hidden states at ``rows``
    (flat indices into ``[B * S]``) and its pooled output is those scores, ``[1 | B, n * L]``.

    The model is called as a whole (so FSDP2's root hooks gather and reduce its parameters),
    but Hugging Face's pooling, which finds each row's last token from ``pad_token_id`` (a real
    token may equal it, and packed rows hold many sequences), is bypassed: the head returns the
    wanted scores broadcast over every position, so whichever position it pools is right.
    """
    head = model.score
    text_config = model.config.get_text_config()
    pad_token_id = text_config.pad_token_id

    def pick_and_score(hidden: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden.shape
        scores = type(head).forward(head, hidden.reshape(b * s, -1)[rows])  # [n, L]
        if b == 1:  # packed: every sequence's scores in the one pooled row
            return scores.reshape(1, 1, -1).expand(1, s, -1)
        return scores[:, None, :].expand(b, s, -1)

    head.forward = pick_and_score
    if pad_token_id is None:  # HF refuses batches > 1 without one; the pooling is moot here
        text_config.pad_token_id = 0
    try:
        yield
    finally:
        del head.forward
        text_config.pad_token_id = pad_token_id


def forward_scores(
    model: PreTrainedModel, mb: BatchedDataDict, options: ForwardOptions
) -> torch.Tensor:
    """``[B, num_labels]`` classifier scores at each sequence's last real token."""
    ids, lengths = mb["input_ids"], mb["input_lengths"].to(mb["input_ids"].device)
    p, inputs = _model_inputs(mb, options)
    if p is None:
        rows = torch.arange(ids.shape[0], device=ids.device) * ids.shape[1] + lengths - 1
    else:
        rows = p.cu_seqlens[:-1].long().to(ids.device) + lengths - 1
    with _score_head_picks(model, rows):
        pooled = model(**inputs).logits
    return pooled.reshape(ids.shape[0], -1)


def teacher_topk_ids(batch: TrainBatch) -> torch.Tensor:
    """The ``[B, S, k]`` token ids a ``GatheredLogprobs`` loss wants the log-probs of."""
    ids = batch.need("teacher_topk_ids", "a loss with input_type GatheredLogprobs", "[B, S, k]")
    if ids.dim() != 3:
        raise ValueError(
            "a loss with input_type GatheredLogprobs needs 'teacher_topk_ids' [B, S, k] (the "
            f"teacher's get_topk_logprobs 'topk_ids'); it has shape {tuple(ids.shape)}"
        )
    return ids[:, : batch.input_ids.shape[1]]


class Output(abc.ABC):
    """One kind of output of a forward pass over a micro-batch: ``output(model, mb,
    options)``, in the micro-batch's row order and padding."""

    #: The ``model.kind`` whose model has this output.
    model_kind: ClassVar[str] = "causal_lm"
    #: What it is called in messages.
    what: ClassVar[str]
    #: ``[B, S, ...]`` per token (else ``[B, ...]``, one per sequence).
    per_token: ClassVar[bool] = True

    @abc.abstractmethod
    def __call__(
        self, model: torch.nn.Module, mb: BatchedDataDict, options: ForwardOptions
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class TokenLogprobs(Output):
    """Next-token log-probs (``forward_logprobs``): of every position, or ``at_loss_tokens``
    only (``loss_token_mask``; 0 elsewhere), and with ``teacher_topk`` also those of the
    batch's ``teacher_topk_ids``, or with ``entropy`` each position's entropy."""

    at_loss_tokens: bool = False
    teacher_topk: bool = False
    entropy: bool = False
    what: ClassVar[str] = "logprobs"

    def __call__(self, model, mb, options):
        batch = TrainBatch.from_transport(mb) if self.at_loss_tokens or self.teacher_topk else None
        wanted = batch.loss_token_mask() > 0 if self.at_loss_tokens else None
        gather_ids = teacher_topk_ids(batch) if self.teacher_topk else None
        out = forward_logprobs(model, mb, options, wanted, gather_ids, self.entropy)
        if wanted is None:
            return out
        # An output layer that cannot compute log-probs itself (a soft-capped or scaled head)
        # gives every position's: zero the others here, so that the result is the same.
        return torch.where(wanted[..., None] if out.dim() == 3 else wanted, out, 0.0)


@dataclass(frozen=True)
class TopkLogprobs(Output):
    """The ``k`` most likely next tokens' log-probs and ids (``forward_topk_logprobs``): what a
    distillation teacher reports."""

    k: int
    what: ClassVar[str] = "top-k logprobs"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"top-k log-probs need k >= 1, got {self.k}")

    def __call__(self, model, mb, options):
        return forward_topk_logprobs(model, mb, options, self.k)


class NextTokenLogits(Output):
    """``[B, S, V]`` next-token logits (``forward_logits``)."""

    what: ClassVar[str] = "logits"

    def __call__(self, model, mb, options):
        return forward_logits(model, mb, options)


@dataclass(frozen=True)
class StateValues(Output):
    """A value model's outputs (``forward_state_values``): unshifted, or ``aligned`` to the
    tokens they choose like log-probs (``align_values``; what a value loss takes)."""

    aligned: bool = False
    model_kind: ClassVar[str] = "value"
    what: ClassVar[str] = "values"

    def __call__(self, model, mb, options):
        values = forward_state_values(model, mb, options)
        return align_values(values, mb["input_lengths"]) if self.aligned else values


class SequenceScores(Output):
    """A sequence classifier's ``[B, num_labels]`` scores (``forward_scores``)."""

    model_kind: ClassVar[str] = "sequence_classification"
    what: ClassVar[str] = "scores"
    per_token: ClassVar[bool] = False

    def __call__(self, model, mb, options):
        return forward_scores(model, mb, options)


#: The output that gives each input a loss may declare (``interfaces.LossInput``).
LOSS_OUTPUTS: dict[type[LossInput], Output] = {
    Logprobs: TokenLogprobs(),
    LossTokenLogprobs: TokenLogprobs(at_loss_tokens=True),
    GatheredLogprobs: TokenLogprobs(at_loss_tokens=True, teacher_topk=True),
    LossTokenLogprobsAndEntropy: TokenLogprobs(at_loss_tokens=True, entropy=True),
    Logits: NextTokenLogits(),
    Values: StateValues(aligned=True),
    Scores: SequenceScores(),
}
