"""Batched sampling from a Hugging Face causal LM with a KV cache, and its log-probs.

Our own decode loop rather than ``model.generate``: the model's ``generation_config.json`` is
never read (sampling settings come from ``SamplingConfig`` only), and each token's log-prob is
computed from the very logits it was sampled from.

Prompts arrive right-padded; they are left-padded here (attention mask and position ids
``0..L-1`` per row) so every row's next token sits in the last column, and the result is
right-padded again: row ``i`` holds its ``L_i`` prompt tokens, then its response, then padding.

Log-probs (the same convention as the vLLM backend, whose ``processed_logprobs`` it follows):
each token's log-prob under the distribution it was actually drawn from, that is
``log_softmax(filter(logits / temperature))`` where ``filter`` is the top-k / top-p truncation.
Without truncation this is what the policy's ``get_logprobs`` with ``logprob_temperature =
temperature`` computes, so on-policy importance ratios are 1; with ``top_k``/``top_p`` it is
higher than the policy's value by ``-log`` of the kept probability mass. Greedy decoding takes
the argmax and reports its log-prob under the model's own distribution (temperature 1, no
truncation), as vLLM does for greedy requests.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from rl_models.generation.config import SamplingConfig


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


def choose_tokens(
    logits: torch.Tensor,
    sampling: SamplingConfig,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens ``[B]`` and their log-probs ``[B]`` (see the module docstring)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        kept = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
        logprobs = torch.log_softmax(kept, dim=-1)
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
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

    def hit(self, row: int, response: Sequence[int]) -> bool:
        strings = self.per_row[row]
        if not strings:
            return False
        text = self.tokenizer.decode(list(response[-self.window[row] :]))
        return any(s in text for s in strings)


@dataclass
class Samples:
    output_ids: torch.Tensor  # [B, S + T] right-padded
    logprobs: torch.Tensor  # [B, S + T]
    generation_lengths: torch.Tensor  # [B]
    truncated: torch.Tensor  # [B] bool


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


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
) -> Samples:
    """One response per row of right-padded ``input_ids`` (see the module docstring).

    A row stops at a stop token (kept in the response), after the token that completes one of
    its stop strings (kept), or after ``max_new_tokens`` (then ``truncated``).
    """
    device = next(model.parameters()).device
    batch, width = input_ids.shape
    lengths = input_lengths.to(torch.long).cpu()
    if batch == 0:
        empty = torch.zeros(0, width, dtype=input_ids.dtype)
        return Samples(empty, empty.float(), lengths.clone(), torch.zeros(0, dtype=torch.bool))
    if int(lengths.min()) < 1:
        raise ValueError("every prompt needs at least one token (input_lengths >= 1)")
    left = torch.full((batch, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        left[i, width - n :] = input_ids[i, :n]
        mask[i, width - n :] = 1
    left, mask = left.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    # The prompt's last position is the only one sampled from: asking for its logits alone
    # spares the LM head [batch, width, vocab] (the largest matmul of a small model's prefill).
    last_only = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
    logits = model(
        input_ids=left,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        **last_only,
    ).logits[:, -1]
    next_position = positions[:, -1:] + 1
    stop_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)

    done = torch.zeros(batch, dtype=torch.bool, device=device)
    # Response length of each row: its stop step + 1, or every step if it never stops.
    gen_lengths = torch.full((batch,), sampling.max_new_tokens, dtype=torch.long, device=device)
    tokens_out, logprobs_out = [], []
    for step in range(sampling.max_new_tokens):
        tokens, logprobs = choose_tokens(logits, sampling, greedy, generator)
        tokens = tokens.masked_fill(done, pad_token_id)
        logprobs = logprobs.masked_fill(done, 0.0)
        tokens_out.append(tokens)
        logprobs_out.append(logprobs)
        stopped = torch.isin(tokens, stop_ids) & ~done
        if stop_strings is not None:
            history = torch.stack(tokens_out, dim=1).cpu()
            for i in (~done & ~stopped).nonzero().flatten().tolist():
                stopped[i] = stop_strings.hit(i, history[i].tolist())
        gen_lengths = torch.where(stopped, step + 1, gen_lengths)
        done |= stopped
        if bool(done.all()) or step == sampling.max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=device)], dim=1)
        logits = model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=next_position,
            past_key_values=cache,
        ).logits[:, -1]
        next_position = next_position + 1

    generated = torch.stack(tokens_out, dim=1).cpu()
    gen_logprobs = torch.stack(logprobs_out, dim=1).float().cpu()
    gen_lengths = gen_lengths.clamp(max=generated.shape[1]).cpu()
    total = lengths + gen_lengths
    out_width = int(total.max())
    output_ids = torch.full((batch, out_width), pad_token_id, dtype=input_ids.dtype)
    logprobs = torch.zeros(batch, out_width, dtype=torch.float32)
    for i, (n, g) in enumerate(zip(lengths.tolist(), gen_lengths.tolist(), strict=True)):
        output_ids[i, :n] = input_ids[i, :n]
        output_ids[i, n : n + g] = generated[i, :g]
        logprobs[i, n : n + g] = gen_logprobs[i, :g]
    return Samples(output_ids, logprobs, gen_lengths, ~done.cpu())
