"""A policy worker whose model is a Megatron-core ``GPTModel`` (tensor/pipeline parallel 1).

Runs in the isolated ``mcore`` environment (see ``rl_models.megatron``). The model is built
from the Hugging Face config of a Llama/Qwen2-family model and given its weights through
``rl_models.megatron.convert``, so it computes the same function as the HF model the DTensor
worker would load from the same ``PolicyConfig`` (same path, or same ``hf_config`` and seed).

Batching, log-prob alignment, loss normalisation, optimiser and scheduler handling are those of
``DTensorPolicyWorker``, which this class extends: the Megatron model sits behind a small
adapter that takes HF-style arguments (``input_ids``, 2-D padding mask or 4-D boolean "may
attend" mask, ``position_ids``) and returns an object with ``.logits``. Every rank holds the
whole model; with several ranks (data parallel) gradients are averaged over ranks before the
optimiser step.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import AutoModelForCausalLM, PretrainedConfig

from rl_models.megatron import cpu_shim
from rl_models.megatron.convert import GPTLayout, hf_to_megatron, megatron_to_hf
from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import (
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    DTensorPolicyWorker,
    build_model,
)


def transformer_config(hf: PretrainedConfig, dtype: torch.dtype) -> TransformerConfig:
    """Megatron's description of a Llama/Qwen2-family HF config (RMSNorm, SwiGLU, RoPE)."""
    if hf.hidden_act != "silu":
        raise ValueError(f"only SwiGLU (hidden_act='silu') is supported, not {hf.hidden_act!r}")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    rope = getattr(hf, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {rope.get('rope_type')!r} is not supported")
    layout = GPTLayout.from_hf_config(hf)
    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        # The shim's no-op RNG fork on CPU relies on there being no dropout.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )


def build_gpt(hf: PretrainedConfig, dtype: torch.dtype) -> GPTModel:
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return GPTModel(
        transformer_config(hf, dtype),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=theta,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
    )


def _load_weights(gpt: GPTModel, weights: dict[str, torch.Tensor]) -> None:
    """Copy converted weights in; every parameter must be given (``_extra_state`` aside)."""
    missing, unexpected = gpt.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit: missing {missing}, unexpected {unexpected}")


class HFStyleGPT(torch.nn.Module):
    """A ``GPTModel`` called like an HF causal LM: ``model(input_ids=...).logits``.

    Masks: a 2-D ``[B, S]`` padding mask (1 = real token) becomes causal attention over real
    keys; a 4-D boolean ``[B|1, 1, S, S]`` mask (True = may attend, the block-diagonal masks of
    packed rows) is used as given. Megatron's masks mean the opposite (True = masked out).

    Megatron's rotary embedding uses positions ``0..S-1`` of the row, not ``position_ids``.
    RoPE scores depend only on query-key distance, and a packed row's block-diagonal mask
    keeps every key in its query's own sequence, so packed rows still give each sequence the
    scores it has alone (up to rounding).
    """

    def __init__(self, gpt: GPTModel) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> SimpleNamespace:
        batch, width = input_ids.shape
        dev = input_ids.device
        if attention_mask is None or attention_mask.dim() == 2:
            allowed = torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None, None]
            if attention_mask is not None:
                allowed = allowed & attention_mask.bool()[:, None, None, :]
        else:
            allowed = attention_mask.bool()
        pos = torch.arange(width, device=dev)[None].expand(batch, width)
        logits = self.gpt(input_ids=input_ids, position_ids=pos, attention_mask=~allowed)
        return SimpleNamespace(logits=logits)


class MegatronPolicyWorker(DTensorPolicyWorker):
    """One data-parallel rank holding a whole Megatron ``GPTModel`` (and optional reference)."""

    def __init__(self, config: PolicyConfig | dict[str, Any]) -> None:
        self.config = PolicyConfig.model_validate(config)
        if self.config.activation_checkpointing:
            raise ValueError("activation_checkpointing is not supported by the Megatron worker")
        lora = getattr(self.config, "lora", None)
        if lora is not None and lora.enabled:
            raise ValueError("LoRA is not supported by the Megatron worker")
        self.lora = False  # read by the inherited reference-policy and checkpoint code
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if "MASTER_ADDR" in os.environ:
                dist.init_process_group(backend, init_method="env://")
            else:  # alone, outside a worker group: Megatron still wants a process group
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        cpu_shim.apply()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        if self.device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(self.config.seed)
        self.dp_size = dist.get_world_size()
        self.rank = dist.get_rank()

        hf = build_model(self.config)  # the exact weights the DTensor worker would start from
        self.hf_config = hf.config
        self.layout = GPTLayout.from_hf_config(hf.config)
        weights = hf_to_megatron(hf.state_dict(), self.layout)
        del hf
        self.model = self._build(weights)
        self.reference: torch.nn.Module | None = None
        if self.config.reference_policy.enabled:
            self.reference = self._build(weights).eval().requires_grad_(False)
            ref_device = "cpu" if self.config.reference_policy.offload_to_cpu else self.device
            self.reference.to(ref_device)
        self._make_optimizer()

    def _build(self, weights: dict[str, torch.Tensor]) -> HFStyleGPT:
        gpt = build_gpt(self.hf_config, self.config.model.torch_dtype)
        _load_weights(gpt, weights)
        return HFStyleGPT(gpt).to(self.device)

    def _make_optimizer(self) -> None:
        opt = self.config.optimizer
        self.optimizer = getattr(torch.optim, opt.name)(self.model.parameters(), **opt.kwargs)
        sched = self.config.scheduler
        self.scheduler = (
            getattr(torch.optim.lr_scheduler, sched.name)(self.optimizer, **sched.kwargs)
            if sched is not None
            else torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        )

    def _clip_and_step(self, params: list[torch.nn.Parameter]) -> float:
        # train() scales each loss by dp_size (FSDP averages gradients); average them here too.
        if self.dp_size > 1:
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= self.dp_size
        return super()._clip_and_step(params)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights under Hugging Face names (CPU copies)."""
        state = self.model.gpt.state_dict()
        # ``_extra_state`` entries (Transformer Engine metadata) are None or bytes, not weights.
        meg = {k: v.detach().cpu() for k, v in state.items() if isinstance(v, torch.Tensor)}
        return {k: v.clone() for k, v in megatron_to_hf(meg, self.layout).items()}

    def save_checkpoint(self, path: str) -> None:
        """HF safetensors weights (``from_pretrained``-loadable) + optimiser + scheduler."""
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            hf = AutoModelForCausalLM.from_config(
                self.hf_config, dtype=self.config.model.torch_dtype
            )
            hf.load_state_dict(self.hf_state_dict())
            hf.save_pretrained(path)
            torch.save(self.optimizer.state_dict(), os.path.join(path, OPTIMIZER_FILE))
            torch.save(self.scheduler.state_dict(), os.path.join(path, SCHEDULER_FILE))
        if self.dp_size > 1:
            dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote (every rank reads ``path``)."""
        saved = AutoModelForCausalLM.from_pretrained(path, dtype=self.config.model.torch_dtype)
        weights = hf_to_megatron(saved.state_dict(), self.layout)
        _load_weights(self.model.gpt, weights)
        optim = torch.load(os.path.join(path, OPTIMIZER_FILE), weights_only=False)
        self.optimizer.load_state_dict(optim)
        self.scheduler.load_state_dict(torch.load(os.path.join(path, SCHEDULER_FILE)))

    def shutdown(self) -> None:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        super().shutdown()
