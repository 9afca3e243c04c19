"""What context parallelism (``policy/context_parallel.py``) refuses, and why, in a module of its
own: the config's validation and NeMo RL's recipe mapping ask these rules without importing
transformers or the attention kernel, which the ``rl`` command's config checks never need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Model families (``model_type``) whose decoder layers are all self-attention followed by a
#: per-token MLP or mixture of experts; ``check_model`` refuses any other. A sequence layer
#: other than attention (LFM2's short convolutions, mamba, linear attention) would run over a
#: rank's two non-adjacent chunks as if they were one sequence, with no error.
FULL_ATTENTION_FAMILIES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
)


def check_model(model: torch.nn.Module, size: int) -> None:
    """Refuse, by name, a model whose sequence mixing the context-parallel kernel does not
    replace whole: attention outside Hugging Face's AttentionInterface, layers other than
    full attention, a family not known to have only those, sliding windows, soft-capping."""
    where = f"policy.dtensor.context_parallel_size={size}"
    config = model.config.get_text_config()
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{where}: {type(model).__name__} does not call its attention through Hugging "
            "Face's AttentionInterface, so its attention cannot be split; use 1"
        )
    other_layers = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    if other_layers:
        raise ValueError(
            f"{where}: model type {config.model_type!r} has {other_layers} layers, which would "
            "run over each rank's chunks as if they were the whole row; only full-attention "
            "layers can be split; use 1"
        )
    if config.model_type not in FULL_ATTENTION_FAMILIES:
        raise ValueError(
            f"{where}: model type {config.model_type!r} is not known to have full-attention "
            f"layers only (known: {sorted(FULL_ATTENTION_FAMILIES)}); use 1"
        )
    windowed = getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    )
    capped = getattr(config, "attn_logit_softcapping", None) is not None
    if windowed or capped:
        what = "sliding-window" if windowed else "soft-capped"
        raise ValueError(f"{where}: the model has {what} attention, which it does not apply")


def context_parallel_clashes(
    *,
    activation_checkpointing: bool,
    attn_implementation: str,
    router_replay: bool,
    lora: bool,
    kind: str,
) -> list[str]:
    """What (``policy.`` keys, with values) ``dtensor.context_parallel_size`` > 1 does not work
    with: the one rule, for the config and NeMo's mapping. Why: its kernel is switched in for
    one forward call, which activation checkpointing's recompute runs outside of; it replaces
    attention with sdpa, so another kernel would silently not run; replayed routes, peft's
    wrapping and a value or classifier head are not split."""
    sdpa = attn_implementation == "sdpa"
    unsupported = {
        "activation_checkpointing": activation_checkpointing,
        f"model.attn_implementation={attn_implementation} (use sdpa)": not sdpa,
        "router_replay": router_replay,
        "lora.enabled": lora,
        f"model.kind={kind}": kind != "causal_lm",
    }
    return [name for name, on in unsupported.items() if on]
