"""A vLLM worker's LoRA adapters (``policy.lora.refit: adapters``): what a refit sends, kept
and written to a peft directory for the engine's ``LoRARequest``.

A refit's buckets mix adapter tensors (``lora_A``/``lora_B``) and, at the first refit, the
frozen base layers under the peft names ``inject_adapters`` gives them
(``...q_proj.base_layer.weight``). ``RefitAdapters`` keeps the first for the directory and hands
the second back under the plain HF names vLLM's model loads.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import replace

import torch

from rl_models.modeling import lora
from rl_models.modeling.lora import LoraConfig
from rl_models.weight_transfer.buckets import PackedBucket, unpack_bucket


class RefitAdapters:
    """The adapters of the LoRA policy ``config`` for one vLLM worker, in a private directory
    (removed by ``close``)."""

    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.directory = tempfile.mkdtemp(prefix="rl-vllm-lora-")
        self.pending: dict[str, torch.Tensor] = {}  # the refit under way's, by export name

    def keep_named(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Keep the adapter tensors among ``named`` (copied: a bucket's memory is reused); the
        others come back under vLLM's (the plain HF) names."""
        base = []
        for name, tensor in named:
            if lora.is_adapter_key(name):
                self.pending[name] = tensor.detach().to("cpu", copy=True)
            else:
                base.append((lora.base_layer_to_plain(name), tensor))
        return base

    def keep_bucket(self, bucket: PackedBucket) -> PackedBucket:
        """``keep_named`` for a packed bucket: the base layers stay in its buffer, renamed."""
        adapters = tuple(s for s in bucket.slots if lora.is_adapter_key(s.name))
        self.keep_named(unpack_bucket(PackedBucket(adapters, bucket.buffer)))
        base = tuple(
            replace(s, name=lora.base_layer_to_plain(s.name))
            for s in bucket.slots
            if not lora.is_adapter_key(s.name)
        )
        return PackedBucket(base, bucket.buffer)

    def write(self) -> str | None:
        """Write the adapters kept since the last call to the directory, replacing what it
        held (a refit sends every adapter); returns it, or None if none were kept."""
        if not self.pending:
            return None
        lora.write_adapter_dir(self.directory, self.pending, self.config)
        self.pending = {}
        return self.directory

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's engine accepts (``MaxLoRARanks``) that is at least ``rank``:
    the engine then serves adapters of any rank up to it."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    ranks = sorted(get_args(MaxLoRARanks))
    for allowed in ranks:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"generation.vllm.max_lora_rank: {rank} is above the highest LoRA rank vLLM serves "
        f"({ranks[-1]})"
    )


def check_servable(config: LoraConfig, max_lora_rank: int | None) -> None:
    """Raise unless an engine started with ``max_lora_rank`` serves ``config``'s adapters."""
    if max_lora_rank is None or max_lora_rank < config.rank:
        started = "without LoRA" if max_lora_rank is None else f"with max_lora_rank {max_lora_rank}"
        raise ValueError(
            f"the vLLM engine started {started}; the policy's adapters (policy.lora.rank: "
            f"{config.rank}) need generation.vllm.max_lora_rank >= {config.rank} (a run sets it "
            "from policy.lora; set it where you build VllmGeneration yourself)"
        )


__all__ = ["RefitAdapters", "check_servable", "vllm_lora_rank"]
