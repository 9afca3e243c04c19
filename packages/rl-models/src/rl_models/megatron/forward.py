"""Forward (and backward) passes of a tensor/pipeline-parallel ``GPTModel`` over micro-batches.

Every rank of a model replica is given the same micro-batches; each builds the model inputs
itself (token ids, positions, attention mask), so pipeline stages exchange only activations.
Megatron's schedule (``get_forward_backward_func``: plain loop for one stage, 1F1B for
several) runs the passes; the last stage turns its vocab-parallel logits into log-probs and
hands them to the loss (or keeps them, for inference). With ``logprob_chunk_size`` the output
layer returns its input instead, and the log-probs are computed from it a chunk of tokens at a
time (``logprobs_from_hidden``), so no ``[tokens, vocab]`` logits tensor is ever made.

Masks: Megatron's ``attention_mask`` is True where attention is *not* allowed. Unpacked rows get
causal attention over their real tokens; a packed row gets a block-diagonal causal mask, so no
token sees another sequence. Megatron's rotary embedding uses the positions ``0..T-1`` of the
row, not ``position_ids``: RoPE scores depend only on query-key distance, and the mask keeps
every key in its query's own sequence, so packed rows give each sequence the scores it has
alone (up to rounding). With sequence parallelism rows are padded to a multiple of the
tensor-parallel size (padding tokens are masked keys, and their log-probs are dropped).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.packing import PackedSequences, pack_sequences, unpack_sequences
from rl_models.policy.logprobs import (
    chunked_vocab_parallel_logprobs as shared_chunked_vocab_parallel_logprobs,
)
from rl_models.policy.logprobs import vocab_parallel_logprobs as shared_vocab_parallel_logprobs

HALF = (torch.float16, torch.bfloat16)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    entropy: bool = False,
) -> torch.Tensor:
    """``log p(targets)`` under ``softmax(logits / temperature)`` from this rank's slice
    ``[..., V/tp]`` of the logits; with ``entropy`` ``[..., 2]``, the log-probs and the
    entropy of each position's whole distribution.

    The shared vocab-parallel log-softmax (``rl_models.policy.logprobs``) over Megatron's
    tensor-parallel group, whose ranks hold equal slices of the padded vocabulary. Megatron's
    ``vocab_parallel_cross_entropy`` would do the same but computes in float32, which float64
    runs (exact comparisons) cannot have.
    """
    start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    group = parallel_state.get_tensor_model_parallel_group()
    return shared_vocab_parallel_logprobs(
        logits, targets, start, vocab_size, group, temperature, entropy
    )


@dataclass
class Inputs:
    """One micro-batch as the model takes it, and how to map its outputs back to rows."""

    data: BatchedDataDict  # the micro-batch itself, on the model's device
    input_ids: torch.Tensor  # [b, s] (packed: [1, T])
    mask: torch.Tensor  # [b|1, 1, s, s], True = masked out
    packed: PackedSequences | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def make_inputs(mb: BatchedDataDict, packed: bool, multiple: int = 1) -> Inputs:
    """Model inputs of one micro-batch; rows padded to a multiple of ``multiple`` tokens."""
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    dev = ids.device
    if not packed:
        width = ids.shape[1]
        padded = _round_up(width, multiple)
        ids = F.pad(ids, (0, padded - width))
        pos = torch.arange(padded, device=dev)
        real = pos[None, :] < lengths[:, None].to(dev)
        allowed = torch.ones(padded, padded, dtype=torch.bool, device=dev).tril()[None, None]
        allowed = allowed & real[:, None, None, :]
        return Inputs(mb, ids, ~allowed, None)
    p = pack_sequences(ids, lengths, pad_multiple=multiple)
    seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=dev), p.cu_seqlens.diff().long().to(dev)
    )
    total = seq.numel()
    causal = torch.ones(total, total, dtype=torch.bool, device=dev).tril()
    allowed = (causal & (seq[:, None] == seq[None, :]))[None, None]
    return Inputs(mb, p.input_ids.to(dev), ~allowed, p)


def chunked_vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    chunk_size: int | None,
    temperature: float = 1.0,
    entropy: bool = False,
) -> torch.Tensor:
    """``log p(targets)`` from the output layer's input ``hidden [..., H]`` (the whole
    sequence, as every tensor-parallel rank has it) and this rank's vocab slice ``weight
    [V/tp, H]``, ``chunk_size`` tokens at a time: at most ``[chunk_size, V/tp]`` logits exist
    at once (recomputed in backward), never ``[tokens, V]``. With ``entropy``, ``[..., 2]``
    (``vocab_parallel_logprobs``)."""
    start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    group = parallel_state.get_tensor_model_parallel_group()
    return shared_chunked_vocab_parallel_logprobs(
        hidden, weight, targets, chunk_size, start, vocab_size, group, None, temperature, entropy
    )


LogprobsOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _next_token_logprobs(values: torch.Tensor, inp: Inputs, logprobs_of: LogprobsOf):
    """``[B, S]`` next-token log-probs (0 at position 0 and on padding); ``values`` are the
    model's per-position outputs (logits or hidden states) and ``logprobs_of(values, targets)``
    turns those of the positions before each target into its log-prob (or ``[..., 2]``, the
    log-prob and the entropy: the result is then ``[B, S, 2]``, aligned alike)."""
    ids, lengths = inp.data["input_ids"], inp.data["input_lengths"]
    width = ids.shape[1]

    def shifted(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # One position to the right (0 in front), zero where ``mask`` is False.
        trailing = lp.dim() - mask.dim()
        lp = F.pad(lp, (*(0, 0) * trailing, 1, 0))
        return lp * mask.view(*mask.shape, *[1] * trailing)

    if inp.packed is None:
        lp = logprobs_of(values[:, : width - 1], ids[:, 1:])
        real = torch.arange(width, device=ids.device)[None, :] < lengths[:, None].to(ids.device)
        return shifted(lp, real)
    p = inp.packed
    row = p.input_ids[0].to(values.device)
    first = p.position_ids[0].to(values.device) > 0  # a sequence's first token has none
    lp = shifted(logprobs_of(values[0, :-1], row[1:]), first)
    return unpack_sequences(lp[None], p.cu_seqlens, lengths, width)


def logprobs_from_logits(
    logits: torch.Tensor,
    inp: Inputs,
    vocab_size: int,
    temperature: float = 1.0,
    entropy: bool = False,
) -> torch.Tensor:
    """``[B, S]`` next-token log-probs of the micro-batch (0 at position 0 and on padding),
    under ``softmax(logits / temperature)``, from the whole (vocab-parallel) logits; with
    ``entropy`` ``[B, S, 2]``, each position's entropy beside its log-prob."""
    return _next_token_logprobs(
        logits, inp, lambda v, t: vocab_parallel_logprobs(v, t, vocab_size, temperature, entropy)
    )


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    inp: Inputs,
    vocab_size: int,
    chunk_size: int | None,
    temperature: float = 1.0,
    entropy: bool = False,
) -> torch.Tensor:
    """As ``logprobs_from_logits``, from the output layer's input and weight, in chunks."""
    return _next_token_logprobs(
        hidden,
        inp,
        lambda h, t: chunked_vocab_parallel_logprobs(
            h, weight, t, vocab_size, chunk_size, temperature, entropy
        ),
    )


class _SumGradOverTensorRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor-parallel group.

    Megatron's ``copy_to_tensor_model_parallel_region`` does the same but all-reduces
    ``grad.contiguous()`` in place: for the non-contiguous gradient that reaches the hidden
    states here (GPTModel transposes its output) the sum lands in a temporary copy and is lost.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        return grad


@contextlib.contextmanager
def output_layer_returns_hidden(gpt: torch.nn.Module) -> Iterator[torch.Tensor | None]:
    """While inside, ``gpt(...)`` returns its output layer's input ``[b, s, H]`` instead of the
    logits; yields the output layer's weight (``None`` on stages without one).

    The hidden states go through what ``ColumnParallelLinear`` does to its input first: the
    all-gather of the sequence (sequence parallelism), or the identity whose backward sums the
    input gradients over the tensor-parallel ranks; so the gradients are the output layer's.
    """
    if not getattr(gpt, "post_process", False):
        yield None
        return
    layer = gpt.output_layer
    weight = (
        gpt.shared_embedding_or_output_weight()
        if gpt.share_embeddings_and_output_weights
        else layer.weight
    )

    def hidden_forward(input_, weight=None, runtime_gather_output=None):
        if layer.sequence_parallel:  # its backward reduce-scatters a contiguous copy: fine
            return gather_from_sequence_parallel_region(input_), None
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            return _SumGradOverTensorRanks.apply(input_), None
        return input_, None

    layer.forward = hidden_forward
    try:
        yield weight
    finally:
        del layer.forward  # back to the class's forward


def aligned_logits(logits: torch.Tensor, inp: Inputs, vocab_size: int) -> torch.Tensor:
    """``[B, S, V]`` next-token logits over the whole vocabulary, aligned like the log-probs
    (``[:, t]`` predicts token ``t``; zeros at position 0 and on padding).

    The vocab slices are all-gathered over the tensor-parallel group (its backward hands each
    rank the gradient of its own slice) and the vocabulary's padding is cut off.
    """
    ids, lengths = inp.data["input_ids"], inp.data["input_lengths"]
    width = ids.shape[1]
    logits = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
    if inp.packed is None:
        real = torch.arange(width, device=ids.device)[None, :] < lengths[:, None].to(ids.device)
        return F.pad(logits[:, : width - 1], (0, 0, 1, 0)) * real[..., None]
    p = inp.packed
    row = F.pad(logits[0, :-1], (0, 0, 1, 0))
    row = row * (p.position_ids[0].to(row.device) > 0)[:, None]
    return unpack_sequences(row[None], p.cu_seqlens, lengths, width)


#: What the last stage does with one micro-batch's output (log-probs or aligned logits):
#: returns the loss to backpropagate (or None when only collecting).
OnOutput = Callable[[torch.Tensor, Inputs], torch.Tensor | None]


def run_pipeline(
    model: torch.nn.Module,
    inputs: list[Inputs],
    on_output: OnOutput,
    vocab_size: int,
    forward_only: bool,
    logits: bool = False,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    entropy: bool = False,
    after_forward: Callable[[Inputs], None] | None = None,
) -> None:
    """Forward (and unless ``forward_only``, backward) every micro-batch through the stages.

    ``on_output`` runs on the last pipeline stage only and gets every position's log-probs
    (with ``entropy`` ``[B, S, 2]``: and each position's entropy), or with ``logits`` the
    aligned logits (``aligned_logits``). Log-probs with a ``chunk_size``
    are computed from the output layer's input, ``chunk_size`` tokens at a time
    (``logprobs_from_hidden``); whole logits are only made for ``logits`` or
    ``chunk_size=None``.
    ``after_forward`` runs on every stage, after the stage's forward of each micro-batch.
    Gradients accumulate in the parameters' ``.grad``; nothing is reduced across data-parallel
    ranks here.
    """
    if not inputs:
        return
    no_tokens = torch.zeros((), dtype=torch.int)

    def forward_step(batches, gpt):
        inp = next(batches)
        width = inp.shape[1]
        pos = torch.arange(width, device=inp.input_ids.device)[None].expand(*inp.shape)
        chunked = not logits and chunk_size is not None
        with output_layer_returns_hidden(gpt) if chunked else contextlib.nullcontext() as weight:
            out = gpt(input_ids=inp.input_ids, position_ids=pos, attention_mask=inp.mask)
        if after_forward is not None:
            after_forward(inp)

        def loss_func(out):
            if logits:
                values = aligned_logits(out, inp, vocab_size)
            elif chunked:  # ``out`` holds the output layer's input here
                values = logprobs_from_hidden(
                    out, weight, inp, vocab_size, chunk_size, temperature, entropy
                )
            else:
                values = logprobs_from_logits(out, inp, vocab_size, temperature, entropy)
            loss = on_output(values, inp)
            if loss is None:  # inference: the schedule only needs a number
                loss = values.new_zeros(())
            # With calculate_per_token_loss the schedule uses the loss as it is.
            return loss, no_tokens, {}

        return out, loss_func

    forward_backward = get_forward_backward_func()
    forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(inputs),
        model=[model],
        num_microbatches=len(inputs),
        # For pipelining, a first guess only: with variable_seq_lengths every activation's
        # shape is sent ahead of it.
        seq_length=max(i.shape[1] for i in inputs),
        micro_batch_size=max(i.shape[0] for i in inputs),
        forward_only=forward_only,
    )


def objects_from_last_stage(obj: Any) -> Any:
    """``obj`` as the last pipeline stage of this replica has it (a collective; picklable
    objects, such as a loss's metrics)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        obj = box[0]
    return obj


def broadcast_from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the last pipeline stage of this replica has it (in place; a collective)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            t,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return t
