"""Batched sampling from a Hugging Face causal LM with a KV cache, and its log-probs.

Our own decode loop rather than ``model.generate``: the model's ``generation_config.json`` is
never read (sampling settings come from ``SamplingConfig`` only), and each token's log-prob is
computed from the very logits it was sampled from.

Prompts arrive right-padded; they are left-padded here (attention mask and position ids
``0..L-1`` per row) so every row's next token sits in the last column, and the result is
right-padded again: row ``i`` holds its ``L_i`` prompt tokens, then its response, then padding.
When the prompts open with a long shared prefix, the cache holds that prefix once per row, then
each prompt's own tail left-padded after it (``prefill_prompts``).

Log-probs (the same convention as the vLLM backend, whose ``processed_logprobs`` it follows):
each token's log-prob under the distribution it was actually drawn from, that is
``log_softmax(filter(logits / temperature))`` where ``filter`` is the top-k / top-p truncation.
Without truncation this is what the policy's ``get_logprobs`` with ``logprob_temperature =
temperature`` computes, so on-policy importance ratios are 1; with ``top_k``/``top_p`` it is
higher than the policy's value by ``-log`` of the kept probability mass. Greedy decoding takes
the argmax and reports its log-prob under the model's own distribution (temperature 1, no
truncation), as vLLM does for greedy requests.

Decoding steps go through a ``Decoder``, chosen once per call by ``start_decoding``: the lean
static-KV decoder (``static_decode.py``) where it mirrors the model, else the model's own
forward over a Hugging Face KV cache (``ForwardDecoder``). Both compute the same logits.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from rl_models.generation.config import SamplingConfig
from rl_models.generation.static_decode import StaticKVDecoder, unsupported_reason
from rl_models.modeling.attention_layout import mixed_attention_reason
from rl_models.modeling.moe_routes import NO_ROUTE, ROUTE_DTYPE, RouteRecorder


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """``logits`` with every token outside the top-k / top-p (nucleus) set at ``-inf``.

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``
    (the most likely token always stays).
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw(
    probs: torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of ``probs [B, V]`` (unnormalised, non-negative), from the
    distribution ``torch.multinomial(probs, 1)`` draws from, by inverting each row's CDF (a
    row of NaN, infinite or all-zero probabilities is an error, as there).

    ``uniforms`` (float64 ``[B, 1]`` in ``[0, 1)``): the numbers to invert, drawn by the caller
    (one random stream per row, ``RowStreams``); else they are drawn here from ``generator``.

    One uniform number per row rather than the many ``multinomial`` uses: on a CPU it is about
    ten times faster at a 50k vocabulary, which matters once per generated token. A token of
    probability 0 is never drawn (a float64 CDF is flat over it).
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("cannot sample: a row's probabilities are NaN, infinite or all zero")
    u = uniforms
    if u is None:
        u = torch.rand(
            probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator
        )
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    tokens = tokens.clamp(max=probs.shape[-1] - 1)
    # u * total may round up to the total itself, past the last token of non-zero probability
    # (rare: checked for, not computed for every row).
    off = probs.gather(-1, tokens[:, None]).squeeze(-1) == 0
    if bool(off.any()):
        last = probs.shape[-1] - 1 - (probs[off] > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
        tokens[off] = last
    return tokens


def next_token_logprobs(
    logits: torch.Tensor, sampling: SamplingConfig, greedy: bool
) -> torch.Tensor:
    """Log-probs ``[B, V]`` of the distribution the next token is drawn from (see the module
    docstring): the model's own for greedy rows, else after temperature and truncation."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if greedy:
        return torch.log_softmax(logits, dim=-1)
    kept = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.log_softmax(kept, dim=-1)


def choose_tokens(
    logits: torch.Tensor,
    sampling: SamplingConfig,
    greedy: bool,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens ``[B]`` and their log-probs ``[B]`` (see the module docstring); ``uniforms``
    as in ``draw``."""
    logprobs = next_token_logprobs(logits, sampling, greedy)
    # Greedy: the arg-max of the logits themselves (log_softmax could round two apart into a tie).
    tokens = logits.argmax(dim=-1) if greedy else draw(logprobs.exp(), generator, uniforms)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class StopStrings:
    """Whether a row's response has just produced one of its stop strings.

    Only the tail of the response is decoded: a string of ``n`` characters spans at most
    ``n`` tokens (plus one for a token that straddles its start).
    """

    def __init__(self, tokenizer, per_row: Sequence[Sequence[str]]) -> None:
        if any(per_row) and tokenizer is None:
            raise ValueError("stop strings need a tokenizer (generation.tokenizer or model.path)")
        self.tokenizer = tokenizer
        self.per_row = [list(s) for s in per_row]
        self.window = [max((len(s) for s in row), default=0) + 1 for row in self.per_row]
        self.any = any(self.per_row)

    def hit(self, row: int, response: Sequence[int]) -> bool:
        strings = self.per_row[row]
        if not strings:
            return False
        text = self.tokenizer.decode(list(response[-self.window[row] :]))
        return any(s in text for s in strings)


class RowStreams:
    """One random stream per row of a batch, each from its own seed
    (``rl_models.generation.seeds``): a row draws the same numbers whatever other rows share
    its batch, and whichever worker samples it."""

    def __init__(self, seeds: Sequence[int]) -> None:
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def uniforms(self, rows: torch.Tensor) -> torch.Tensor:
        """The next number of each row in ``rows`` (indices into the seeds), float64
        ``[len(rows), 1]`` on ``rows``' device. On the host: one generator call per row is
        cheap next to a decoding step, and a device generator per row would be a launch each."""
        gens = self.generators
        u = torch.cat(
            [torch.rand(1, dtype=torch.float64, generator=gens[r]) for r in rows.tolist()]
        )
        return u[:, None].to(rows.device)


@dataclass
class Samples:
    output_ids: torch.Tensor  # [B, S + T] right-padded
    logprobs: torch.Tensor  # [B, S + T]
    generation_lengths: torch.Tensor  # [B]
    truncated: torch.Tensor  # [B] bool
    # [B, S + T, layers, k] (``record_routes``): the experts each token was routed to.
    routed_experts: torch.Tensor | None = None
    # With ``sampling.first_token_logprobs`` k > 0: the k most likely first response tokens of
    # each row ([B, k], most likely first) and their log-probs, as ``next_token_logprobs``.
    first_top_ids: torch.Tensor | None = None
    first_top_logprobs: torch.Tensor | None = None


class Decoder(Protocol):
    """Decoding steps from the KV cache of a batch of prompts (``start_decoding`` makes one)."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """These rows (indices into the current batch; one may repeat, to copy a shared
        prompt's cache) decode from now on."""
        ...

    def __call__(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[B, V]`` of the next token after ``tokens [B]``: ``attention_mask [B, T]``
        covers every cached token and this one (1: attend), ``positions [B, 1]`` are the
        tokens' positions."""
        ...


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


class ForwardDecoder:
    """Decoding steps by the model's own forward, its keys and values in a ``DynamicCache``:
    a ``Decoder`` for any causal LM, started by ``prefill``."""

    def __init__(self, model: torch.nn.Module, cache: DynamicCache) -> None:
        self.model, self.cache = model, cache

    @classmethod
    def prefill(
        cls,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | None = None,
    ) -> tuple[torch.Tensor, ForwardDecoder]:
        """The logits ``[B, V]`` at the last position of left-padded prompts, and the decoder
        of the steps after them; ``cache``: keys and values already computed for the tokens
        before ``input_ids`` (``attention_mask`` covers them too)."""
        cache = DynamicCache(config=model.config) if cache is None else cache
        # The prompt's last position is the only one sampled from: asking for its logits alone
        # spares the LM head [batch, width, vocab] (the largest matmul of a small model's
        # prefill).
        last_only = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            **last_only,
        ).logits[:, -1]
        return logits, cls(model, cache)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.reorder_cache(rows)

    def __call__(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        return self.model(
            input_ids=tokens[:, None],
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=self.cache,
        ).logits[:, -1]


def start_decoding(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    new_tokens: int,
    static_kv: bool,
    cache: DynamicCache | None = None,
) -> tuple[torch.Tensor, Decoder]:
    """The logits ``[B, V]`` at the last position of left-padded prompts, and the decoder of up
    to ``new_tokens`` steps after them: with ``static_kv``, the lean decoder where it mirrors
    the model (after a prefill by the model's own decoder stack); else the model's forward
    throughout. ``cache``: a prefix's keys and values, as the prefills take it."""
    if static_kv and unsupported_reason(model) is None:
        return StaticKVDecoder.prefill(
            model, input_ids, attention_mask, position_ids, new_tokens, cache
        )
    return ForwardDecoder.prefill(model, input_ids, attention_mask, position_ids, cache)


#: Distinct prompts that begin with the same tokens have that prefix prefilled once when it
#: is at least this long (a long system prompt, the tools' schemas an agent is shown). A chat
#: template's header of a few dozen tokens saves little next to the decoding steps, and its
#: prompts then keep the one prefill they had.
MIN_SHARED_PREFIX = 64


def shared_prefix_length(input_ids: torch.Tensor, lengths: torch.Tensor) -> int:
    """How many leading tokens all rows of right-padded ``input_ids`` have in common, short of
    the shortest row's last token: every row keeps a token of its own, the one whose logits
    its first response token is drawn from."""
    span = int(lengths.min()) - 1
    if len(input_ids) < 2 or span < 1:
        return 0
    same = (input_ids[:, :span] == input_ids[:1, :span]).all(dim=0)
    return span if bool(same.all()) else int((~same).to(torch.uint8).argmax())


@dataclass
class Prefill:
    """What a prefill leaves for the decoding steps: the logits ``[B, V]`` at each prompt's
    last token, the decoder, and the attention mask over the cached columns (1: a real token)
    with each row's next position ``[B, 1]``."""

    logits: torch.Tensor
    decoder: Decoder
    mask: torch.Tensor
    next_position: torch.Tensor


@torch.no_grad()
def prefill_prompts(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    lengths: torch.Tensor,
    new_tokens: int,
    *,
    pad_token_id: int,
    static_kv: bool,
    share_prefix: bool,
) -> Prefill:
    """Prefill the right-padded ``prompts`` (one row per prompt) for up to ``new_tokens``
    decoding steps.

    With ``share_prefix``, the leading tokens every prompt shares (``shared_prefix_length``,
    when at least ``MIN_SHARED_PREFIX``) run once, as a batch of one, and their keys and values
    are copied to every row; only each prompt's own tail is prefilled per row. The cache then
    holds the prefix, then the tails left-padded: padding sits between them, masked. Positions
    and the causal order are those of each whole prompt, so for a model of plain causal
    attention the logits are those of a prefill of the whole prompts up to float rounding (the
    sums run in other shapes; in bf16 that can flip a near tie). A model with a sliding window,
    chunked attention, recurrent layers or a length-scaled rotary embedding
    (``mixed_attention_reason``) is prefilled whole: the padding would change what it computes."""
    device = next(model.parameters()).device
    rows, width = prompts.shape
    shared = 0
    if share_prefix and mixed_attention_reason(model.config) is None:
        shared = shared_prefix_length(prompts, lengths)
    shared = shared if shared >= MIN_SHARED_PREFIX else 0
    cache = None
    if shared:
        cache = DynamicCache(config=model.config)
        prefix = prompts[:1, :shared].to(device)
        # The decoder stack alone: only the prefix's keys and values are wanted, no logits.
        model.get_decoder()(
            input_ids=prefix,
            attention_mask=torch.ones_like(prefix),
            position_ids=torch.arange(shared, device=device)[None],
            past_key_values=cache,
            use_cache=True,
        )
        cache.reorder_cache(torch.zeros(rows, dtype=torch.long, device=device))
    tail_width = width - shared
    left = torch.full((rows, tail_width), pad_token_id, dtype=torch.long)
    tail_mask = torch.zeros(rows, tail_width, dtype=torch.long)
    for k, n in enumerate(lengths.tolist()):
        left[k, width - n :] = prompts[k, shared:n]
        tail_mask[k, width - n :] = 1
    left, tail_mask = left.to(device), tail_mask.to(device)
    positions = shared + (tail_mask.cumsum(-1) - 1).clamp(min=0)
    mask = torch.cat([torch.ones(rows, shared, dtype=torch.long, device=device), tail_mask], 1)
    logits, decoder = start_decoding(model, left, mask, positions, new_tokens, static_kv, cache)
    return Prefill(logits, decoder, mask, positions[:, -1:] + 1)


def _distinct_prompts(
    input_ids: torch.Tensor, lengths: torch.Tensor
) -> tuple[list[int], list[int]]:
    """The first row of each distinct prompt, and for every row the index of its prompt there."""
    first: dict[tuple[int, ...], int] = {}
    row_of = []
    for i, n in enumerate(lengths.tolist()):
        key = tuple(input_ids[i, :n].tolist())
        row_of.append(first.setdefault(key, len(first)))
    firsts = [0] * len(first)
    for i, k in reversed(list(enumerate(row_of))):
        firsts[k] = i
    return firsts, row_of


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    sampling: SamplingConfig,
    *,
    greedy: bool = False,
    stop_token_ids: Sequence[int] = (),
    stop_strings: StopStrings | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    row_seeds: Sequence[int] | None = None,
    static_kv: bool = True,
    record_routes: bool = False,
    share_prefix: bool = True,
) -> Samples:
    """One response per row of right-padded ``input_ids`` (see the module docstring).

    Randomness: with ``row_seeds`` (one per row) each row draws from its own stream
    (``RowStreams``), so its response depends on its seed alone; else the whole batch draws
    from ``generator`` (the global RNG if None). Greedy decoding draws nothing.

    A row stops at a stop token (kept in the response), after the token that completes one of
    its stop strings (kept), or after ``max_new_tokens`` (then ``truncated``).

    Savings that change no result: rows with the same prompt (a GRPO group) share one
    prefill, its KV cache copied to each; and once a quarter of the rows still decoding have
    stopped, they leave the batch (and the cache), so a few long answers do not keep every
    finished row computing. One more changes values by float rounding only: with
    ``share_prefix``, distinct prompts that open with the same long prefix (an agent's tool
    schemas) prefill it once (``prefill_prompts`` says when it applies).

    ``record_routes`` (a mixture-of-experts model): ``routed_experts`` holds, per position of
    ``output_ids``, the experts each MoE layer's router chose when that token went through the
    model: a prompt token in the prefill, a response token in the decoding step that fed it.
    A response's last token is never fed (nothing is sampled after it), so it has ``NO_ROUTE``,
    as padding does; the trainer's router chooses there, which changes no log-prob a loss uses.
    """
    recorder = RouteRecorder(model) if record_routes else None
    with recorder or contextlib.nullcontext():
        return _sample(
            model,
            input_ids,
            input_lengths,
            sampling,
            greedy,
            stop_token_ids,
            stop_strings,
            pad_token_id,
            generator,
            row_seeds,
            static_kv,
            recorder,
            share_prefix,
        )


def _sample(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    sampling: SamplingConfig,
    greedy: bool,
    stop_token_ids: Sequence[int],
    stop_strings: StopStrings | None,
    pad_token_id: int,
    generator: torch.Generator | None,
    row_seeds: Sequence[int] | None,
    static_kv: bool,
    recorder: RouteRecorder | None,
    share_prefix: bool,
) -> Samples:
    device = next(model.parameters()).device
    batch, width = input_ids.shape
    lengths = input_lengths.to(torch.long).cpu()
    top_k = sampling.first_token_logprobs
    if batch == 0:
        empty = torch.zeros(0, width, dtype=input_ids.dtype)
        routed = None
        if recorder is not None:  # as many layers and experts as a full batch's
            shape = (0, width, len(recorder.routers), int(recorder.routers[0].top_k))
            routed = torch.zeros(shape, dtype=ROUTE_DTYPE)
        top = (torch.zeros(0, top_k, dtype=torch.long), torch.zeros(0, top_k)) if top_k else ()
        return Samples(
            empty, empty.float(), lengths.clone(), torch.zeros(0, dtype=torch.bool), routed, *top
        )
    if int(lengths.min()) < 1:
        raise ValueError("every prompt needs at least one token (input_lengths >= 1)")
    firsts, row_of = _distinct_prompts(input_ids, lengths)
    prefill = prefill_prompts(
        model,
        input_ids[firsts],
        lengths[firsts],
        sampling.max_new_tokens,
        pad_token_id=pad_token_id,
        static_kv=static_kv,
        # Routes are recorded per prompt column; a prefix run apart would need its own.
        share_prefix=share_prefix and recorder is None,
    )
    logits, decoder, mask = prefill.logits, prefill.decoder, prefill.mask
    next_position = prefill.next_position
    if recorder is not None:  # the prefill's routes, [prompts, width, layers, k] left-padded
        routes = recorder.take()
        prompt_routes = routes.view(len(firsts), width, *routes.shape[1:]).cpu()
    # Per decoding step, the rows it fed and their routes (kept on the device until the end).
    fed: list[tuple[torch.Tensor, torch.Tensor]] = []
    if len(firsts) < batch:  # one copy of its prompt's cache per row
        expand = torch.tensor(row_of, device=device)
        decoder.select_rows(expand)
        logits, mask, next_position = logits[expand], mask[expand], next_position[expand]
    stop_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    check_strings = stop_strings is not None and stop_strings.any

    rows = torch.arange(batch, device=device)  # the row of each sequence still in the cache
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    # Response length of each row: its stop step + 1, or every step if it never stops.
    gen_lengths = torch.full((batch,), sampling.max_new_tokens, dtype=torch.long, device=device)
    generated = torch.full(
        (batch, sampling.max_new_tokens), pad_token_id, dtype=torch.long, device=device
    )
    gen_logprobs = torch.zeros(batch, sampling.max_new_tokens, dtype=torch.float32, device=device)
    if row_seeds is not None and len(row_seeds) != batch:
        raise ValueError(f"{len(row_seeds)} row seeds for a batch of {batch} rows")
    streams = RowStreams(row_seeds) if row_seeds is not None and not greedy else None
    first_top = None
    if top_k:  # every row is still in the batch, in order, at the first step
        values, ids = next_token_logprobs(logits, sampling, greedy).topk(top_k, dim=-1)
        first_top = (ids.cpu(), values.float().cpu())
    steps = 0
    for step in range(sampling.max_new_tokens):
        steps = step + 1
        uniforms = streams.uniforms(rows) if streams is not None else None
        tokens, logprobs = choose_tokens(logits, sampling, greedy, generator, uniforms)
        live = ~done[rows]  # rows that stopped but are still in the cache sample nothing
        live_rows, tokens_live = rows[live], tokens[live]
        generated[live_rows, step] = tokens_live
        gen_logprobs[live_rows, step] = logprobs[live].float()
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        stopped[live_rows] = torch.isin(tokens_live, stop_ids)
        if check_strings:
            assert stop_strings is not None
            history = generated[:, :steps].cpu()
            for i in (~done & ~stopped).nonzero().flatten().tolist():
                stopped[i] = stop_strings.hit(i, history[i].tolist())
        gen_lengths = torch.where(stopped, steps, gen_lengths)
        done |= stopped
        if bool(done.all()) or steps == sampling.max_new_tokens:
            break
        still = ~done[rows]
        if int(still.sum()) <= 3 * len(rows) // 4:
            keep = still.nonzero().flatten()
            decoder.select_rows(keep)
            rows, tokens, mask, next_position = (
                rows[keep],
                tokens[keep],
                mask[keep],
                next_position[keep],
            )
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype, device=device)], dim=1)
        logits = decoder(tokens, mask, next_position)
        if recorder is not None:  # rows that stopped before this step fed filler: not kept
            fed.append((rows, recorder.take()))
        next_position = next_position + 1

    generated = generated[:, :steps].cpu()
    gen_logprobs = gen_logprobs[:, :steps].cpu()
    gen_lengths = gen_lengths.clamp(max=steps).cpu()
    total = lengths + gen_lengths
    out_width = int(total.max())
    output_ids = torch.full((batch, out_width), pad_token_id, dtype=input_ids.dtype)
    logprobs = torch.zeros(batch, out_width, dtype=torch.float32)
    for i, (n, g) in enumerate(zip(lengths.tolist(), gen_lengths.tolist(), strict=True)):
        output_ids[i, :n] = input_ids[i, :n]
        output_ids[i, n : n + g] = generated[i, :g]
        logprobs[i, n : n + g] = gen_logprobs[i, :g]
    routed = None
    if recorder is not None:
        per_token = prompt_routes.shape[2:]
        gen_routes = torch.full((batch, steps, *per_token), NO_ROUTE, dtype=ROUTE_DTYPE)
        for step, (fed_rows, step_routes) in enumerate(fed):
            gen_routes[fed_rows.cpu(), step] = step_routes.cpu()
        routed = torch.full((batch, out_width, *per_token), NO_ROUTE, dtype=ROUTE_DTYPE)
        for i, (n, g) in enumerate(zip(lengths.tolist(), gen_lengths.tolist(), strict=True)):
            routed[i, :n] = prompt_routes[row_of[i], width - n :]
            # The last response token was never fed (see ``sample``).
            routed[i, n : n + g - 1] = gen_routes[i, : max(g - 1, 0)]
    return Samples(output_ids, logprobs, gen_lengths, ~done.cpu(), routed, *(first_top or ()))
