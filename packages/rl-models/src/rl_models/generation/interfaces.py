"""What the algorithms see of a generator.

``generate`` takes a ``BatchedDataDict`` with

- ``input_ids`` ``[B, S]``: right-padded prompt token ids; ``input_lengths`` ``[B]``;
- ``stop_strings`` (optional): one ``list[str] | None`` per sample, added to the configured ones;

and returns a ``BatchedDataDict`` with

- ``output_ids`` ``[B, S + T]``: prompt followed by response, right-padded with the pad id;
- ``generation_lengths`` ``[B]``: response tokens generated (stop token included if produced);
- ``unpadded_sequence_lengths`` ``[B]``: ``input_lengths + generation_lengths``;
- ``logprobs`` ``[B, S + T]`` float32: each response token's log-prob under the distribution it
  was sampled from (temperature applied), 0 on prompt tokens and padding;
- ``truncated`` ``[B]`` bool: the response hit ``max_new_tokens`` without stopping.

Weights carry a version: the policy counts its optimiser steps, a refit stamps the version it
copied onto the generator, and ``generate(..., expected_weight_version=v)`` refuses to sample
from any other version (``StaleWeightsError``), so a skipped refit can never go unnoticed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from rl_distributed.batched_data_dict import BatchedDataDict


class StaleWeightsError(RuntimeError):
    """The generator holds other weights than the controller expects."""

    def __init__(self, loaded: int, expected: int) -> None:
        super().__init__(
            f"generation holds weight version {loaded} but version {expected} was expected: "
            "refit the generator from the policy before generating"
        )
        self.loaded = loaded
        self.expected = expected


class GenerationInterface(ABC):
    """A sampler over a worker group, whatever engine runs inside."""

    weight_version: int  # the version of the weights the workers hold now

    @abstractmethod
    def generate(
        self,
        data: BatchedDataDict,
        greedy: bool = False,
        *,
        expected_weight_version: int | None = None,
    ) -> BatchedDataDict:
        """Sample one response per row (see the module docstring for keys)."""

    @abstractmethod
    def prepare_for_generation(self) -> None:
        """Wake the engine (load weights / KV cache onto the device) before ``generate``."""

    @abstractmethod
    def finish_generation(self) -> None:
        """Release device memory (weights / KV cache) so a colocated policy can train."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their resources."""
