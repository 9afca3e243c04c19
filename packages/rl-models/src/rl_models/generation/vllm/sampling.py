"""Our sampling settings as vLLM ``SamplingParams`` keywords, and vLLM's answers as our batch.

Pure Python and torch (no vLLM import), so the driver and fast tests can use it.

Every setting comes from ``SamplingConfig``: the engine is started with
``generation_config="vllm"`` (a model's ``generation_config.json`` gives no default sampling
parameters) and every request sets ``ignore_eos=True`` with explicit ``stop_token_ids``, because
vLLM otherwise also stops on the EOS ids listed in ``generation_config.json``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.config import SamplingConfig
from rl_models.generation.interfaces import check_generate_input, stop_strings_of
from rl_models.generation.seeds import seeds_of


def sampling_kwargs(
    config: SamplingConfig,
    greedy: bool,
    eos_token_ids: Sequence[int],
    extra_stop_strings: Sequence[str] | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request.

    ``greedy`` takes the arg-max token (vLLM: temperature 0); its log-probs are then those of
    the model's own distribution (temperature 1), the one vLLM reports for greedy requests.
    """
    stop_ids = list(eos_token_ids) if config.stop_token_ids is None else config.stop_token_ids
    stop = list(dict.fromkeys([*config.stop_strings, *(extra_stop_strings or [])]))
    return {
        "n": 1,
        "temperature": 0.0 if greedy else config.temperature,
        "top_p": 1.0 if greedy else config.top_p,
        "top_k": 0 if greedy or config.top_k is None else config.top_k,  # vLLM: 0 = off
        "max_tokens": config.max_new_tokens,
        "stop": stop,
        "stop_token_ids": list(stop_ids),
        "ignore_eos": True,  # stop only on our stop_token_ids (not generation_config's EOS)
        "include_stop_str_in_output": True,
        # The sampled token's log-prob, and the k most likely tokens' where they are asked for.
        "logprobs": config.first_token_logprobs,
        "detokenize": bool(stop),  # text is needed only to find stop strings
        "skip_special_tokens": False,
        "seed": seed,
    }


def request_kwargs(
    config: SamplingConfig, greedy: bool, eos_token_ids: Sequence[int], data: BatchedDataDict
) -> list[dict[str, Any]]:
    """``sampling_kwargs`` of each row of a generate batch: the row's extra stop strings, and
    its seed (``generation.seeds``) unless the batch is greedy or carries no seeds (then the
    engine's own generator samples it)."""
    seeds = None if greedy else seeds_of(data)
    return [
        sampling_kwargs(config, greedy, eos_token_ids, stops, None if seeds is None else seed)
        for stops, seed in zip(stop_strings_of(data), seeds or [None] * data.size, strict=True)
    ]


@dataclass(frozen=True)
class Response:
    """One finished sample as the worker read it from vLLM's ``CompletionOutput``."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool  # finish_reason == "length"
    # The most likely first tokens and their log-probs, most likely first (first_token_logprobs).
    first_top: tuple[tuple[int, float], ...] = ()
    # The weight version that sampled each token (``sampled_versions``); None where vLLM
    # did not label them all with one of the worker's versions.
    versions: tuple[int, ...] | None = None


def sampled_versions(completion: Any) -> tuple[int, ...] | None:
    """The weight version of each token of a finished ``CompletionOutput``, read from vLLM's
    spans of version labels (``weight_versions``: tokens ``[start, end)`` were sampled while
    the engine's label was ``version``; the worker labels each version with its number).
    None when vLLM reported no spans, or a token has no label that is a number (an engine
    whose label was never set says ``"default"``)."""
    spans = getattr(completion, "weight_versions", None)
    count = len(completion.token_ids)
    if spans is None:
        return None
    versions: list[int | None] = [None] * count
    for span in spans:
        try:
            version = int(span.version)
        except (TypeError, ValueError):
            return None
        versions[span.start : span.end] = [version] * (min(span.end, count) - span.start)
    if len(versions) != count or any(v is None for v in versions):
        return None
    return tuple(versions)  # type: ignore[arg-type]


def most_likely(step: Mapping[int, Any], k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely ``(token, log-prob)`` of one position's vLLM log-probs (a dict of
    token id to ``Logprob``: the top ones asked for, and the sampled token even when it is not
    among them)."""
    ranked = sorted(step.items(), key=lambda item: item[1].logprob, reverse=True)
    return tuple((int(token), float(lp.logprob)) for token, lp in ranked[:k])


def prompts_of(data: BatchedDataDict) -> list[list[int]]:
    """The unpadded prompt of each row; a clear error on malformed input."""
    check_generate_input(data)
    ids, lengths = data["input_ids"], data["input_lengths"]
    return [ids[row, :n].tolist() for row, n in enumerate(lengths.tolist())]


def assemble(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    responses: Sequence[Response],
    pad_token_id: int,
    first_token_logprobs: int = 0,
) -> BatchedDataDict:
    """The generate() result (see ``rl_models.generation.interfaces``) of one batch; with
    ``first_token_logprobs`` k > 0, each response's ``first_top`` as ``first_token_top_ids`` /
    ``first_token_top_logprobs`` (a row with fewer than k: id -1, log-prob -inf after them)."""
    batch, width = input_ids.shape
    gen_lengths = torch.tensor([len(r.token_ids) for r in responses], dtype=torch.long)
    total = width + int(gen_lengths.max()) if len(responses) else width
    output_ids = torch.full((batch, total), pad_token_id, dtype=input_ids.dtype)
    logprobs = torch.zeros((batch, total), dtype=torch.float32)
    for row, (n, response) in enumerate(zip(input_lengths.tolist(), responses, strict=True)):
        output_ids[row, :n] = input_ids[row, :n]
        end = n + len(response.token_ids)
        output_ids[row, n:end] = torch.tensor(response.token_ids, dtype=input_ids.dtype)
        logprobs[row, n:end] = torch.tensor(response.logprobs, dtype=torch.float32)
    out = BatchedDataDict(
        output_ids=output_ids,
        generation_lengths=gen_lengths,
        unpadded_sequence_lengths=input_lengths.to(torch.long) + gen_lengths,
        logprobs=logprobs,
        truncated=torch.tensor([r.truncated for r in responses], dtype=torch.bool),
    )
    if first_token_logprobs:
        k = first_token_logprobs
        top_ids = torch.full((batch, k), -1, dtype=torch.long)
        top_logprobs = torch.full((batch, k), float("-inf"), dtype=torch.float32)
        for row, response in enumerate(responses):
            for j, (token, logprob) in enumerate(response.first_top[:k]):
                top_ids[row, j], top_logprobs[row, j] = token, logprob
        out["first_token_top_ids"], out["first_token_top_logprobs"] = top_ids, top_logprobs
    return out


def stream_versions(
    width: int, start: int, response: Response, started: int, finished: int
) -> dict[str, torch.Tensor]:
    """A streamed sample's weight versions: ``generation_versions`` (one row of ``width``
    positions like its ``output_ids``: the version of each token sampled from ``start`` on, -1
    elsewhere) and the oldest and newest of them (``weight_version_min`` / ``_max``). Where
    vLLM did not label every token (``response.versions`` None), each gets ``started``, the
    version its request started on (never too young), and the newest is ``finished``, the
    worker's version when it finished; the keys are always there, so a stream's samples
    stack."""
    count = len(response.token_ids)
    tags = torch.full((1, width), -1, dtype=torch.long)
    if response.versions is not None and count:
        tags[0, start : start + count] = torch.tensor(response.versions)
        oldest, newest = min(response.versions), max(response.versions)
    else:
        tags[0, start : start + count] = started
        oldest, newest = started, finished
    return {
        "generation_versions": tags,
        "weight_version_min": torch.tensor([oldest]),
        "weight_version_max": torch.tensor([newest]),
    }
