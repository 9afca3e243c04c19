"""A toy generation backend, ``generation.backend: echo``: every response repeats its prompt.

The whole backend is this module: its config (the keys ``generation:`` takes under it), its
controller (a ``GenerationInterface``) and its registration. Importing the module registers it;
from then on ``generation.backend: echo`` validates, ``rl_algorithms.actors.make_generator``
builds an ``EchoGeneration``, and ``rl <cmd> --help`` lists ``generation.repeats``. See
docs/guides/generation-backends.md.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.backends import GENERATION_BACKENDS, Backend
from rl_models.generation.config import GenerationConfig
from rl_models.generation.interfaces import (
    GenerationInterface,
    StaleWeightsError,
    check_generate_input,
)


class EchoGenerationConfig(GenerationConfig):
    """``backend: echo``: the prompt, repeated, as the response (no model is run)."""

    backend: Literal["echo"] = "echo"
    # How many times the prompt is repeated (cut to sampling.max_new_tokens).
    repeats: int = Field(1, ge=1)


class EchoGeneration(GenerationInterface):
    """Answers every prompt with the prompt itself, ``repeats`` times, on the driver.

    A real backend starts a worker group on ``cluster`` here (``RayWorkerGroup``); its workers
    implement ``GenerationWorker``, which is how ``refit`` copies the policy's weights in. This
    one holds no weights, so it cannot be refit: it shows the shape of a backend, not training.
    """

    def __init__(
        self,
        cluster: Any,
        config: GenerationConfig | dict[str, Any],
        model: Any = None,
        name_prefix: str = "echo",
    ) -> None:
        self.config = GenerationConfig.model_validate(config)
        if not isinstance(self.config, EchoGenerationConfig):
            raise ValueError(
                f"EchoGeneration needs generation.backend: echo, not {self.config.backend!r}"
            )
        self.worker_group = None
        self.weight_version = 0

    def generate(
        self,
        data: BatchedDataDict,
        greedy: bool = False,
        *,
        expected_weight_version: int | None = None,
    ) -> BatchedDataDict:
        check_generate_input(data)
        if expected_weight_version not in (None, self.weight_version):
            raise StaleWeightsError(self.weight_version, expected_weight_version)
        ids, lengths = data["input_ids"], data["input_lengths"]
        limit = self.config.sampling.max_new_tokens
        responses = []
        for row, length in zip(ids, lengths.tolist(), strict=True):
            responses.append(row[:length].repeat(self.config.repeats)[:limit])
        width = ids.shape[1] + max(len(r) for r in responses)
        output_ids = torch.zeros(len(responses), width, dtype=ids.dtype)  # pad id 0
        for i, (length, response) in enumerate(zip(lengths.tolist(), responses, strict=True)):
            output_ids[i, :length] = ids[i, :length]
            output_ids[i, length : length + len(response)] = response
        generated = torch.tensor([len(r) for r in responses])
        prompt_repeats = lengths * self.config.repeats
        return BatchedDataDict(
            output_ids=output_ids,
            generation_lengths=generated,
            unpadded_sequence_lengths=lengths + generated,
            # Each token is certain: log-prob 0 (also on the prompt and padding, by convention).
            logprobs=torch.zeros(output_ids.shape, dtype=torch.float32),
            truncated=prompt_repeats > limit,
        )

    def prepare_for_generation(self) -> None:
        pass  # nothing to wake: no weights, no KV cache

    def finish_generation(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


GENERATION_BACKENDS.register(Backend("echo", EchoGenerationConfig, f"{__name__}:EchoGeneration"))
