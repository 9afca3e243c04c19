"""Typed configuration of a policy (model, optimiser, batching): ``PolicyConfig``, one class
per backend (``DTensorPolicyConfig``, ``MegatronPolicyConfig``) chosen by ``policy.backend``."""

from __future__ import annotations

import difflib
import inspect
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from rl_distributed.config import ConfigModel
from rl_models.backends import POLICY_BACKENDS, Backend, BackendConfig, BackendRegistry
from rl_models.modeling.config import DType, ModelConfig  # noqa: F401 (DType: re-exported)
from rl_models.modeling.lora import LoraConfig
from rl_models.modeling.precision import HalfSetting
from rl_models.policy.context_parallel_rules import context_parallel_clashes


def check_kwargs(cls: type, kwargs: dict[str, Any], given_by_us: int) -> None:
    """Refuse keyword arguments ``cls`` does not take, and required ones that are missing.

    ``given_by_us``: how many leading parameters the worker passes itself (the parameters, or
    the optimizer).
    """
    params = list(inspect.signature(cls).parameters.values())[given_by_us:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return  # takes anything: nothing to check
    names = [p.name for p in params]
    for key in kwargs:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; it takes {names}"
            raise ValueError(f"{cls.__name__} has no argument {key!r}{hint}")
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    missing = [name for name in required if name not in kwargs]
    if missing:
        raise ValueError(f"{cls.__name__} needs {', '.join(map(repr, missing))}")


def _torch_class(module: Any, name: str, owner: str) -> type:
    # NeMo RL recipes write full paths ("torch.optim.lr_scheduler.LinearLR")
    short = name.removeprefix(f"{module.__name__}.")
    cls = getattr(module, short, None)
    if not isinstance(cls, type):
        known = [
            n for n, c in vars(module).items() if isinstance(c, type) and not n.startswith("_")
        ]
        # a difference of case first ("Adamw" is AdamW, not Adam)
        close = [n for n in known if n.lower() == short.lower()]
        close = close or difflib.get_close_matches(short, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{owner}.name: {module.__name__} has no {short!r}{hint}")
    return cls


class OptimizerConfig(ConfigModel):
    """A class of ``torch.optim`` by name, with its keyword arguments (checked against it)."""

    # A torch.optim class name (AdamW, SGD, ...).
    name: str = "AdamW"
    # Its keyword arguments (lr, weight_decay, ...), checked against the class before any worker
    # starts.
    kwargs: dict[str, Any] = Field(default_factory=lambda: {"lr": 1e-5})

    @field_validator("name")
    @classmethod
    def _exists(cls, name: str) -> str:
        return _torch_class(torch.optim, name, "optimizer").__name__

    # a field validator, not a model one: errors then name the key (policy.optimizer.kwargs)
    @field_validator("kwargs")
    @classmethod
    def _taken(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "name" in info.data:  # else the name was refused already
            check_kwargs(getattr(torch.optim, info.data["name"]), kwargs, given_by_us=1)
        # torch reads these as truthy: "false" or "maybe" would silently pick a kernel.
        for key in ("fused", "foreach"):
            if not isinstance(kwargs.get(key), bool | None):
                raise ValueError(f"{key} must be true, false or null, not {kwargs[key]!r}")
        return kwargs


class SchedulerConfig(ConfigModel):
    """A class of ``torch.optim.lr_scheduler`` by name, stepped once per optimiser step; its
    keyword arguments are checked against it (all it requires, nothing it does not take)."""

    # A torch.optim.lr_scheduler class name (LinearLR, CosineAnnealingLR, ...).
    name: str
    # Its keyword arguments, checked against the class (all it requires, nothing it does not take).
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _exists(cls, name: str) -> str:
        scheduler = _torch_class(torch.optim.lr_scheduler, name, "scheduler")
        if scheduler.__name__ in (
            "SequentialLR",
            "ChainedScheduler",
            "LambdaLR",
            "MultiplicativeLR",
        ):
            raise ValueError(
                f"scheduler.name: {scheduler.__name__} takes schedulers or functions, which a "
                "config cannot hold; give a list of schedulers and milestones instead (see "
                "SchedulerMilestones)"
            )
        return scheduler.__name__

    @field_validator("kwargs")
    @classmethod
    def _taken(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "name" in info.data:
            scheduler = getattr(torch.optim.lr_scheduler, info.data["name"])
            check_kwargs(scheduler, kwargs, given_by_us=1)
        return kwargs


class SchedulerMilestones(ConfigModel):
    """The steps at which a chain of schedulers moves on to the next one (NeMo RL's form).

    ``policy.scheduler`` as a list: the schedulers, then ``{milestones: [...]}``, one step per
    hand-over. Warm-up for 10 steps, then cosine decay over 90::

        scheduler:
          - {name: LinearLR, kwargs: {start_factor: 0.1, total_iters: 10}}
          - {name: CosineAnnealingLR, kwargs: {T_max: 90, eta_min: 1.0e-7}}
          - {milestones: [10]}

    Each scheduler counts its steps from its own start (``SequentialLR``).
    """

    # The steps at which a chain of schedulers hands over to the next (one per hand-over).
    milestones: list[int]


SchedulerSpec = SchedulerConfig | list[SchedulerConfig | SchedulerMilestones]


def check_scheduler_chain(chain: list[SchedulerConfig | SchedulerMilestones]) -> None:
    """A chain is schedulers then one milestones entry, with one milestone per hand-over."""
    schedulers = [s for s in chain if isinstance(s, SchedulerConfig)]
    marks = [s for s in chain if isinstance(s, SchedulerMilestones)]
    if not schedulers:
        raise ValueError("scheduler: the list holds no scheduler")
    if len(schedulers) == 1 and not marks:
        return
    if len(marks) != 1 or not isinstance(chain[-1], SchedulerMilestones):
        raise ValueError(
            "scheduler: a list of several schedulers ends with one {milestones: [...]} entry"
        )
    milestones = marks[0].milestones
    if len(milestones) != len(schedulers) - 1:
        raise ValueError(
            f"scheduler.milestones: {len(schedulers)} schedulers need {len(schedulers) - 1} "
            f"milestones (the steps where each hands over), got {milestones}"
        )
    if any(m <= 0 for m in milestones) or milestones != sorted(set(milestones)):
        raise ValueError(f"scheduler.milestones: {milestones} must be increasing positive steps")


def build_scheduler(
    optimizer: torch.optim.Optimizer, spec: SchedulerSpec | None
) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler ``policy.scheduler`` describes (None: a constant learning rate)."""
    lr_scheduler = torch.optim.lr_scheduler
    if spec is None:
        return lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    if isinstance(spec, SchedulerConfig):
        return getattr(lr_scheduler, spec.name)(optimizer, **spec.kwargs)
    schedulers = [s for s in spec if isinstance(s, SchedulerConfig)]
    if len(schedulers) == 1:
        return build_scheduler(optimizer, schedulers[0])
    milestones = next(s for s in spec if isinstance(s, SchedulerMilestones)).milestones
    return lr_scheduler.SequentialLR(
        optimizer, [build_scheduler(optimizer, s) for s in schedulers], milestones=milestones
    )


class SequencePackingConfig(ConfigModel):
    """Pack each micro-batch's sequences into one row of at most this many tokens.

    Meant for the flash-attention kernels (GPU), which run packed rows as variable-length
    sequences (not measured here). On a CPU (sdpa with a dense block-diagonal mask, whose
    attention cost grows with the square of the packed row) ``bench/train_step.py`` measured
    packing slower than dynamic batching, though faster than fixed micro-batches trimmed to
    their longest row (docs/benchmarks.md), so the CPU default is dynamic batching
    (``dynamic_batching.enabled: auto``).
    """

    # Pack each micro-batch's sequences into rows of at most max_tokens_per_microbatch tokens.
    enabled: bool = False
    # Token budget of one packed row.
    max_tokens_per_microbatch: int = Field(4096, ge=1)
    # Token budget of one packed row for log-prob (and value) inference, which keeps no
    # activations for a backward pass and so may pack more; None: max_tokens_per_microbatch.
    logprob_max_tokens_per_microbatch: int | None = Field(None, ge=1)
    algorithm: str = "first_fit_decreasing"  # a name in rl_distributed.packing's PACKING_ALGORITHMS

    @field_validator("algorithm")
    @classmethod
    def _known(cls, name: str) -> str:
        from rl_distributed.packing import get_packing_algorithm

        get_packing_algorithm(name)  # a ValueError listing the known ones
        return name


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

    # true, false or auto (dynamic batching on CPU, fixed micro-batches on GPU; fixed whenever
    # sequence packing is on).
    enabled: bool | Literal["auto"] = "auto"
    # Padded-token budget of a training micro-batch (None, train_micro_batch_size times the batch's
    # width).
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

    # Every rank writes its own shards (torch.distributed.checkpoint) instead of gathering to rank
    # 0.
    sharded: bool = False


class MegatronConfig(ConfigModel):
    """Model parallelism of the Megatron-core backend (data parallel is what is left over)."""

    # Ranks each layer's matrices are split over (Megatron backend).
    tensor_parallel_size: int = Field(1, ge=1)
    # Pipeline stages the layers are split into (Megatron backend).
    pipeline_parallel_size: int = Field(1, ge=1)
    # Split activations along the sequence in the tensor-parallel regions (needs TP > 1).
    sequence_parallel: bool = False
    # Ranks each layer's experts are split over (mixture-of-experts models). Carved out of the
    # data-parallel ranks: it must divide the data-parallel size and the number of experts.
    expert_parallel_size: int = Field(1, ge=1)
    # Weight of the routers' load-balancing loss (Megatron's per-layer "aux_loss", summed over
    # layers) in the training loss; 0 turns it off. Mixture-of-experts models only.
    moe_aux_loss_coeff: float = Field(0.0, ge=0)


class DTensorConfig(ConfigModel):
    """Model parallelism of the DTensor backend (NeMo RL's ``dtensor_cfg`` names): the workers
    form a ``(data parallel, tensor parallel)`` mesh; FSDP2 shards over the first dimension.
    With context parallelism they form a ``(data parallel, context parallel, tensor parallel)``
    mesh instead, and FSDP2 shards over the first two dimensions as one.

    Tensor parallelism needs a model family with a plan (Llama, Qwen2) whose attention heads
    (and key/value heads) divide by ``tensor_parallel_size``; ``policy/tensor_parallel.py``.
    Context parallelism needs a model of full-attention layers only, called through Hugging
    Face's attention interface (``policy/context_parallel_rules.check_model``)."""

    # Ranks each decoder layer's matrices (and the vocabulary) are split over; the workers'
    # count must be a multiple of it (the rest is data parallel).
    tensor_parallel_size: int = Field(1, ge=1)
    # Split the activations between blocks (norms, residual stream) along the sequence across
    # the tensor-parallel ranks (needs tensor_parallel_size > 1).
    sequence_parallel: bool = False
    # Ranks each row's tokens (padded or packed) are split over along the sequence; each
    # attends to the others' keys, all-gathered. For long sequences: activations per rank
    # shrink with it. The workers' count must be a multiple of it (times
    # tensor_parallel_size: each context-parallel rank can be split by tensor parallelism too).
    context_parallel_size: int = Field(1, ge=1)


class ReferencePolicyConfig(ConfigModel):
    """A frozen copy of the initial weights, for KL penalties."""

    # Keep a frozen copy of the initial weights (needed by KL penalties and DPO).
    enabled: bool = False
    # Keep the copy in host memory and move it to the device only while it is used.
    offload_to_cpu: bool = True


class OffloadConfig(ConfigModel):
    """Where weights and optimiser state go while another engine (e.g. vLLM) uses the device.

    ``prepare_for_lp_inference`` moves the optimiser state to ``device`` when
    ``optimizer_state`` is set; ``prepare_for_training`` brings everything back. The worker's
    ``offload_weights`` / ``offload_optimizer_state`` / ``reload`` do the moves on demand.
    """

    # Move the optimiser state to offload.device while the policy is not training.
    optimizer_state: bool = False
    # Host memory normally; any torch device string (the CPU-only tests use "cpu" copies).
    device: str = "cpu"


class PolicyConfig(BackendConfig):
    """A trained model: its backend (``backend``), optimiser, batching and memory settings.

    Validating ``{"backend": name, ...}`` gives that backend's config class; the keys below are
    every backend's, each backend's own are in its class.
    """

    registry: ClassVar[BackendRegistry] = POLICY_BACKENDS

    model: ModelConfig
    # "dtensor": HF model sharded with FSDP2 (system environment); "megatron": Megatron-core
    # GPTModel with tensor/pipeline parallelism (isolated `mcore` environment).
    backend: str = "dtensor"
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    # One scheduler, or a chain of them (see SchedulerMilestones); None: constant learning rate.
    scheduler: SchedulerSpec | None = None
    max_grad_norm: float | None = Field(1.0, gt=0)  # None: no clipping
    # Samples per optimiser step, across all data-parallel ranks.
    train_global_batch_size: int = Field(ge=1)
    # Samples per forward/backward pass on one rank (gradients accumulate over micro-batches).
    train_micro_batch_size: int = Field(1, ge=1)
    logprob_micro_batch_size: int | None = Field(None, ge=1)  # None: train_micro_batch_size
    # Log-probs are computed this many tokens at a time in the output layer (recomputed in
    # backward), so no [tokens, vocab] float32 logits exist at once; None: all tokens at once.
    # Both backends; Megatron with tensor parallelism makes [chunk, vocab / tp] logits per rank
    # and all-reduces the log-softmax over the vocabulary shards.
    # Losses that ask for whole logits (input_type = Logits, of rl_models.interfaces) always
    # get them in full.
    logprob_chunk_size: int | None = Field(1024, ge=1)
    # Losses that read the loss tokens' log-probs only (GRPO's, SFT's): rows of a micro-batch
    # that share their tokens before the first loss token (a GRPO group's prompt) run those
    # tokens once, the rows' other tokens attending to it (policy/shared_prefix.py), where it
    # saves FLOPs. Equal up to float rounding; padded micro-batches, sdpa, no sliding windows.
    share_prompt_prefix: bool = True
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    # Recompute activations in backward instead of keeping them (less memory, more compute).
    activation_checkpointing: bool = False
    # Compute in bfloat16 while the weights, gradients' reduction and optimiser state stay in
    # model.dtype (normally float32): FSDP2's MixedPrecisionPolicy when sharded, autocast alone.
    # "auto": bfloat16 where the worker's device computes it natively (GPUs, CPUs with
    # AVX512-BF16 or AMX), none elsewhere (emulated bfloat16 is several times slower).
    # Megatron: computes in model.dtype (bf16 over float32 weights is not wired up), so "auto"
    # there is none and "bfloat16" is refused.
    mixed_precision: HalfSetting | None = None
    reference_policy: ReferencePolicyConfig = Field(default_factory=ReferencePolicyConfig)
    # Log-probs (get_logprobs and logprob losses) of softmax(logits / T): set it to the
    # generator's sampling temperature, so on-policy importance ratios are exactly 1.
    logprob_temperature: float = Field(1.0, gt=0)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    # A mixture-of-experts model: every forward over a batch that carries the generator's
    # ``routed_experts`` routes each token to the experts the generator chose for it, weighted
    # by this router's probabilities (rl_models.modeling.moe_routes), so the loss's log-probs
    # come from the experts that sampled the tokens. Turns share_prompt_prefix off (its split
    # forward would need the routes split alike). DTensor backend; the generator must record
    # routes (GRPO's config sets generation.record_routed_experts).
    router_replay: bool = False
    # Seeds everything the policy workers draw: a model built from hf_config's initial weights,
    # a new reward or value head, LoRA's adapters, and dropout in training (per rank and
    # optimiser step, so a resumed run drops what the uninterrupted one did; the Megatron
    # backend runs without dropout).
    seed: int = 0

    @model_validator(mode="after")
    def _compatible(self) -> PolicyConfig:
        if self.sequence_packing.enabled and self.dynamic_batching.enabled is True:
            raise ValueError("enable sequence_packing or dynamic_batching, not both")
        if self.lora.enabled and self.checkpoint.sharded:
            # The sharded writer would save peft's unmerged, prefixed tensors, which
            # from_pretrained cannot read (it would silently start from random weights).
            raise ValueError(
                "lora.enabled does not work with checkpoint.sharded: set checkpoint.sharded: "
                "false (LoRA checkpoints gather the merged model, plus the adapters, on rank 0)"
            )
        if self.lora.enabled and self.model is not None and self.model.kind != "causal_lm":
            # The adapters are set up as peft's causal-LM task, which a reward or value model
            # fails at start-up (and its new head would stay frozen and untrained). A critic
            # whose model is left out gets PPO's own message.
            raise ValueError(
                f"lora.enabled works with model.kind=causal_lm only, not {self.model.kind}: "
                "train a reward or value model with lora.enabled: false"
            )
        if isinstance(self.scheduler, list):
            check_scheduler_chain(self.scheduler)
        return self

    @property
    def model_kind(self) -> str:
        """``model.kind``; only a critic's config leaves its model out (PPO fills in the
        policy's, with a value head), so a missing model is a value model."""
        return self.model.kind if self.model is not None else "value"

    @property
    def model_parallel_layout(self) -> tuple[int, int]:
        """``(pipeline stages, tensor-parallel ranks)`` of one copy of the model: (1, 1) where
        each worker holds a whole copy (FSDP shards it, but per data-parallel rank)."""
        return 1, 1

    @property
    def context_parallel_size(self) -> int:
        """Ranks that split each row along the sequence between them (they share batches)."""
        return 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks that share one data-parallel rank's batches (1 for FSDP's data parallel)."""
        pipeline, tensor = self.model_parallel_layout
        return pipeline * tensor * self.context_parallel_size

    # What a backend's workers can compute beyond log-probs and logits. A backend claims a
    # capability by overriding it, so one registered later claims none it has not built;
    # distillation's config checks read these before any worker starts.

    @property
    def supports_topk_logprobs(self) -> bool:
        """Whether the workers can give the ``k`` most likely next tokens' log-probs at every
        position (``Policy.get_topk_logprobs``, a distillation teacher's answer)."""
        return False

    @property
    def supports_gathered_logprobs(self) -> bool:
        """Whether the workers can train a loss that reads log-probs at given token ids
        (``input_type = GatheredLogprobs``: a top-k distillation student's)."""
        return False

    @property
    def supports_token_entropy(self) -> bool:
        """Whether the workers can train a loss that reads each token's whole-vocabulary
        entropy beside its log-prob (``input_type = LossTokenLogprobsAndEntropy``: an entropy
        bonus)."""
        return False

    @property
    def supports_mixed_precision(self) -> bool:
        """Whether the workers can compute in bfloat16 over weights of ``model.dtype``."""
        return False

    @property
    def lp_micro_batch_size(self) -> int:
        return self.logprob_micro_batch_size or self.train_micro_batch_size


def worker_config(backend: str, config: PolicyConfig | dict[str, Any]) -> PolicyConfig:
    """``config`` validated for a worker of ``backend``; a config naming another backend is
    refused, since its settings would otherwise be silently ignored by this worker."""
    config = PolicyConfig.model_validate(config)
    if config.backend != backend:
        raise ValueError(
            f"a {backend!r} policy worker was given a config for backend {config.backend!r}; "
            f"set the section's backend: {backend} (or start the {config.backend!r} worker)"
        )
    return config


class DTensorPolicyConfig(PolicyConfig):
    """``backend: dtensor``: the Hugging Face model, sharded with FSDP2 over the workers, and
    with ``dtensor.tensor_parallel_size`` > 1 split by tensor parallelism too."""

    backend: Literal["dtensor"] = "dtensor"
    dtensor: DTensorConfig = Field(default_factory=DTensorConfig)

    @model_validator(mode="after")
    def _model_parallelism_supports_it(self) -> DTensorPolicyConfig:
        tp = self.dtensor.tensor_parallel_size
        if self.dtensor.sequence_parallel and tp == 1:
            raise ValueError("dtensor.sequence_parallel needs dtensor.tensor_parallel_size > 1")
        if (cp := self.dtensor.context_parallel_size) > 1:
            # Only a critic's config leaves its model out: the policy's, with a value head.
            model = self.model
            named = context_parallel_clashes(
                activation_checkpointing=self.activation_checkpointing,
                attn_implementation=model.attn_implementation if model else "sdpa",
                router_replay=self.router_replay,
                lora=self.lora.enabled,
                kind=self.model_kind,
            )
            if named:
                raise ValueError(
                    f"dtensor.context_parallel_size={cp} does not work with {', '.join(named)}; "
                    "use context_parallel_size 1 for these"
                )
        if tp == 1:
            return self
        # Why each is refused: peft wraps the very linear layers the plan splits (its
        # adapters would need plans of their own); a value or classifier head is a plain
        # layer the plan leaves whole, fed split activations. (The shared-prompt pass, which
        # builds its own attention outside the plan's hooks, is skipped, not refused: it
        # changes speed, not results.)
        unsupported = {
            "lora.enabled": self.lora.enabled,
            f"model.kind={self.model_kind}": self.model_kind != "causal_lm",
        }
        named = [k for k, on in unsupported.items() if on]
        if named:
            raise ValueError(
                f"dtensor.tensor_parallel_size={tp} does not work with {', '.join(named)}; "
                "use tensor_parallel_size 1 (FSDP2 alone) for these"
            )
        return self

    @property
    def model_parallel_layout(self) -> tuple[int, int]:
        return 1, self.dtensor.tensor_parallel_size

    @property
    def context_parallel_size(self) -> int:
        return self.dtensor.context_parallel_size

    @property
    def supports_topk_logprobs(self) -> bool:
        return True

    @property
    def supports_gathered_logprobs(self) -> bool:
        return True

    @property
    def supports_token_entropy(self) -> bool:
        return True

    @property
    def supports_mixed_precision(self) -> bool:
        return True


class MegatronPolicyConfig(PolicyConfig):
    """``backend: megatron``: a Megatron-core GPTModel with tensor and pipeline parallelism."""

    backend: Literal["megatron"] = "megatron"
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)

    @property
    def supports_token_entropy(self) -> bool:
        return True  # vocab-parallel (rl_models.megatron.forward.vocab_parallel_logprobs)

    @model_validator(mode="after")
    def _megatron_supports_it(self) -> MegatronPolicyConfig:
        # mixed_precision would need fp32 master weights behind Megatron's bf16 model (its
        # Float16Module + DistributedOptimizer), and checkpoint.sharded its dist-checkpointing:
        # neither is wired up, so both are refused rather than ignored.
        unsupported = {
            "lora.enabled": self.lora.enabled,
            "activation_checkpointing": self.activation_checkpointing,
            f"model.kind={self.model_kind}": self.model_kind != "causal_lm",
            # "auto" asks for bfloat16 only where it is native: here it is simply never.
            "mixed_precision": self.mixed_precision == "bfloat16",
            "checkpoint.sharded": self.checkpoint.sharded,
            "router_replay": self.router_replay,
        }
        named = [k for k, on in unsupported.items() if on]
        if named:
            raise ValueError(
                f"backend 'megatron' does not support {', '.join(named)}; use backend "
                "'dtensor' for these, or model.dtype for the Megatron weights' precision"
            )
        if self.megatron.sequence_parallel and self.megatron.tensor_parallel_size == 1:
            raise ValueError("megatron.sequence_parallel needs tensor_parallel_size > 1")
        return self

    @property
    def model_parallel_layout(self) -> tuple[int, int]:
        return self.megatron.pipeline_parallel_size, self.megatron.tensor_parallel_size


POLICY_BACKENDS.register(
    Backend("dtensor", DTensorPolicyConfig, "rl_models.policy.dtensor_worker:DTensorPolicyWorker")
)
POLICY_BACKENDS.register(
    Backend(
        "megatron",
        MegatronPolicyConfig,
        "rl_models.megatron.worker:MegatronPolicyWorker",
        python_env="mcore",  # the root workspace's mcore extra
        workers="rl_models.megatron",
    )
)
