"""Typed configuration of a policy (model, optimiser, batching)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from rl_distributed.config import ConfigModel
from rl_models.modeling.config import DType, ModelConfig  # noqa: F401 (DType: re-exported)


class OptimizerConfig(ConfigModel):
    """A class of ``torch.optim`` by name, with its keyword arguments."""

    name: str = "AdamW"
    kwargs: dict[str, Any] = Field(default_factory=lambda: {"lr": 1e-5})

    @model_validator(mode="after")
    def _exists(self) -> OptimizerConfig:
        if not isinstance(getattr(torch.optim, self.name, None), type):
            raise ValueError(f"torch.optim has no optimizer {self.name!r}")
        return self


class SchedulerConfig(ConfigModel):
    """A class of ``torch.optim.lr_scheduler`` by name, stepped once per optimiser step."""

    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _exists(self) -> SchedulerConfig:
        if not isinstance(getattr(torch.optim.lr_scheduler, self.name, None), type):
            raise ValueError(f"torch.optim.lr_scheduler has no scheduler {self.name!r}")
        return self


class SequencePackingConfig(ConfigModel):
    """Pack each micro-batch's sequences into one row of at most this many tokens.

    Meant for the flash-attention kernels (GPU), which run packed rows as variable-length
    sequences (not measured here). On a CPU (sdpa with a dense block-diagonal mask, whose
    attention cost grows with the square of the packed row) ``bench/train_step.py`` measured
    packing slower than dynamic batching (0.84x-0.99x over two runs on a shared 2-core
    machine; packing was 1.4x-1.7x over fixed micro-batches trimmed to their longest row), so
    the CPU default is dynamic batching (``dynamic_batching.enabled: auto``).
    """

    enabled: bool = False
    max_tokens_per_microbatch: int = Field(4096, ge=1)
    algorithm: str = "first_fit_decreasing"


class DynamicBatchingConfig(ConfigModel):
    """Micro-batches of varying row count holding about the same number of (padded) tokens.

    Rows are sorted by length within each global batch and cut so that ``rows * padded length``
    stays under the budget; each micro-batch is padded only to its own longest row.

    ``enabled``: true, false, or ``auto`` (the default): dynamic batching when the policy runs
    on the CPU, where it measured fastest (see ``SequencePackingConfig``), fixed micro-batches
    of ``train_micro_batch_size`` rows on GPUs; always fixed when ``sequence_packing`` is on.
    The choice is logged, and is ``Policy.batching`` / the worker's ``batching``.

    Token budgets left unset (None) are ``train_micro_batch_size`` (for log-probs
    ``logprob_micro_batch_size``) times the batch's padded width: no micro-batch then holds
    more tokens than a fixed micro-batch of that many rows would, so the micro-batch size
    still bounds memory.
    """

    enabled: bool | Literal["auto"] = "auto"
    train_mb_tokens: int | None = Field(None, ge=1)
    logprob_mb_tokens: int | None = Field(None, ge=1)  # None: train_mb_tokens if set
    sequence_length_round: int = Field(1, ge=1)  # pad each micro-batch to a multiple of this


class CheckpointConfig(ConfigModel):
    """How ``save_checkpoint`` writes.

    ``sharded=False``: full state dicts are gathered to rank 0, which writes everything (simple,
    and fine while the model fits in one host's memory). ``sharded=True``: every rank writes its
    own shards with ``torch.distributed.checkpoint`` (weights through the Hugging Face
    safetensors writer, then consolidated into ``from_pretrained``-loadable files; optimiser
    state as a resharding-capable DCP checkpoint), so no rank ever holds the whole model.
    Not with LoRA (its checkpoint is the merged model, gathered) nor the Megatron backend.
    """

    sharded: bool = False


class MegatronConfig(ConfigModel):
    """Model parallelism of the Megatron-core backend (data parallel is what is left over)."""

    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    # Split activations along the sequence in the tensor-parallel regions (needs TP > 1).
    sequence_parallel: bool = False


class ReferencePolicyConfig(ConfigModel):
    """A frozen copy of the initial weights, for KL penalties."""

    enabled: bool = False
    # Keep the copy in host memory and move it to the device only while it is used.
    offload_to_cpu: bool = True


class LoraConfig(ConfigModel):
    """Low-rank adapters (``peft``): ``W + (alpha / rank) * B @ A`` on each target module.

    When enabled only the adapters train; the base weights stay frozen and bit-identical.
    """

    enabled: bool = False
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # Names (suffixes) of the modules to adapt; the default covers Llama-style attention + MLP.
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )


class OffloadConfig(ConfigModel):
    """Where weights and optimiser state go while another engine (e.g. vLLM) uses the device.

    ``prepare_for_lp_inference`` moves the optimiser state to ``device`` when
    ``optimizer_state`` is set; ``prepare_for_training`` brings everything back. The worker's
    ``offload_weights`` / ``offload_optimizer_state`` / ``reload`` do the moves on demand.
    """

    optimizer_state: bool = False
    # Host memory normally; any torch device string (the CPU-only tests use "cpu" copies).
    device: str = "cpu"


class PolicyConfig(ConfigModel):
    model: ModelConfig
    # "dtensor": HF model sharded with FSDP2 (system environment); "megatron": Megatron-core
    # GPTModel with tensor/pipeline parallelism (isolated `mcore` environment).
    backend: Literal["dtensor", "megatron"] = "dtensor"
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = None  # None: constant learning rate
    max_grad_norm: float | None = Field(1.0, gt=0)  # None: no clipping
    train_global_batch_size: int = Field(ge=1)
    train_micro_batch_size: int = Field(1, ge=1)
    logprob_micro_batch_size: int | None = Field(None, ge=1)  # None: train_micro_batch_size
    # Log-probs are computed this many tokens at a time in the output layer (recomputed in
    # backward), so no [tokens, vocab] float32 logits exist at once; None: all tokens at once.
    # Both backends; Megatron with tensor parallelism makes [chunk, vocab / tp] logits per rank
    # and all-reduces the log-softmax over the vocabulary shards.
    # Losses that ask for whole logits (loss_input_type "logits") always get them in full.
    logprob_chunk_size: int | None = Field(1024, ge=1)
    # Losses that read the loss tokens' log-probs only (GRPO's, SFT's): rows of a micro-batch
    # that share their tokens before the first loss token (a GRPO group's prompt) run those
    # tokens once, the rows' other tokens attending to it (policy/shared_prefix.py), where it
    # saves FLOPs. Equal up to float rounding; padded micro-batches, sdpa, no sliding windows.
    share_prompt_prefix: bool = True
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    activation_checkpointing: bool = False
    # Compute in bfloat16 while the weights, gradients' reduction and optimiser state stay in
    # model.dtype (normally float32): FSDP2's MixedPrecisionPolicy when sharded, autocast alone.
    mixed_precision: Literal["bfloat16"] | None = None
    reference_policy: ReferencePolicyConfig = Field(default_factory=ReferencePolicyConfig)
    # Log-probs (get_logprobs and logprob losses) of softmax(logits / T): set it to the
    # generator's sampling temperature, so on-policy importance ratios are exactly 1.
    logprob_temperature: float = Field(1.0, gt=0)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    seed: int = 0

    @model_validator(mode="after")
    def _compatible(self) -> PolicyConfig:
        if self.sequence_packing.enabled and self.dynamic_batching.enabled is True:
            raise ValueError("enable sequence_packing or dynamic_batching, not both")
        if self.backend == "megatron":
            # mixed_precision would need fp32 master weights behind Megatron's bf16 model
            # (its Float16Module + DistributedOptimizer), and checkpoint.sharded its
            # dist-checkpointing: neither is wired up, so both are refused rather than ignored.
            unsupported = {
                "lora.enabled": self.lora.enabled,
                "activation_checkpointing": self.activation_checkpointing,
                "model.kind=sequence_classification": self.model.kind != "causal_lm",
                "mixed_precision": self.mixed_precision is not None,
                "checkpoint.sharded": self.checkpoint.sharded,
            }
            named = [k for k, on in unsupported.items() if on]
            if named:
                raise ValueError(
                    f"backend 'megatron' does not support {', '.join(named)}; use backend "
                    "'dtensor' for these, or model.dtype for the Megatron weights' precision"
                )
        elif self.megatron != MegatronConfig():
            raise ValueError("megatron.* settings need backend: megatron")
        if self.lora.enabled and self.checkpoint.sharded:
            # The sharded writer would save peft's unmerged, prefixed tensors, which
            # from_pretrained cannot read (it would silently start from random weights).
            raise ValueError(
                "lora.enabled does not work with checkpoint.sharded: set checkpoint.sharded: "
                "false (LoRA checkpoints gather the merged model, plus the adapters, on rank 0)"
            )
        if self.megatron.sequence_parallel and self.megatron.tensor_parallel_size == 1:
            raise ValueError("megatron.sequence_parallel needs tensor_parallel_size > 1")
        return self

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model between them (1 for FSDP's data parallel)."""
        if self.backend == "dtensor":
            return 1
        return self.megatron.tensor_parallel_size * self.megatron.pipeline_parallel_size

    @property
    def lp_micro_batch_size(self) -> int:
        return self.logprob_micro_batch_size or self.train_micro_batch_size
