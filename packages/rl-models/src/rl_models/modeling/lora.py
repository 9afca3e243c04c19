"""LoRA through ``peft``: its config, wrapping the policy model, merging and saving its adapters,
and applying them on a generator (the policy and the generators both use this module).

Checkpoint layout with LoRA (``save_lora_checkpoint``)::

    path/                    the merged model, ``W + scaling * B @ A`` in every adapted layer:
      config.json            plain HF safetensors, ``AutoModelForCausalLM.from_pretrained``
      model.safetensors      loads it with no ``peft`` at all
    path/adapter/            the adapters alone, ``peft.PeftModel.from_pretrained(base, ...)``
      adapter_config.json
      adapter_model.safetensors

Merging works on the gathered full state dict (``base_layer.weight`` + ``lora_A``/``lora_B``), so
it is the same with and without FSDP and never touches the training model's weights (peft's
``merge_adapter``/``unmerge_adapter`` would round the frozen base weights).

A refit (``generation/refit.py``) sends a generator either that merged model or, where the
generator can apply adapters (``inject_adapters``), the adapters alone: what a
``weight_export`` exporter selects is a ``LoraExport``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from rl_distributed.config import ConfigModel


class LoraConfig(ConfigModel):
    """Low-rank adapters (``peft``): ``W + (alpha / rank) * B @ A`` on each target module.

    When enabled only the adapters train; the base weights stay frozen and bit-identical.
    """

    # Train low-rank adapters only; the base weights stay frozen.
    enabled: bool = False
    # Rank of the adapters' A and B matrices.
    rank: int = Field(8, ge=1)
    # Scale of the adapters' update, alpha / rank.
    alpha: float = Field(16.0, gt=0)
    # Dropout on the adapters' input.
    dropout: float = Field(0.0, ge=0, lt=1)
    # Names (suffixes) of the modules to adapt; the default covers Llama-style attention + MLP.
    # ["all-linear"] (or "all-linear"): every linear layer but the output layer, as peft
    # defines it.
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

    # What a refit sends the generator: "adapters" (only the lora_A/lora_B tensors, bytes
    # proportional to the rank; the generator applies them with its base weights, which it gets
    # once), "merged" (W + scaling * B @ A of every adapted layer, the whole model each time,
    # for generators that cannot load adapters: chosen explicitly), or "auto", the default and
    # today an alias of "adapters" (HF and vLLM load them). "auto" or "adapters" with a generator that cannot load adapters is
    # refused when the run's config is read, saying to set "merged": never a silent switch.
    refit: Literal["auto", "adapters", "merged"] = "auto"

    @field_validator("target_modules", mode="before")
    @classmethod
    def _all_linear_alone(cls, names: Any) -> Any:
        if names == "all-linear":
            return ["all-linear"]
        if isinstance(names, list):
            if not names:
                raise ValueError("empty: name modules, or all-linear")
            if "all-linear" in names and len(names) > 1:
                raise ValueError("'all-linear' already covers the others; give it alone")
        return names


ADAPTER_DIR = "adapter"
ADAPTER_NAME = "default"  # peft's name for the one adapter
_PEFT_PREFIX = "base_model.model."

#: What a LoRA policy exports to a generator: ``merged`` (``W + scaling * B @ A`` under the plain
#: HF names), ``adapters`` (the ``lora_A``/``lora_B`` tensors only) or ``with_base`` (every
#: tensor unmerged: the frozen base layers and the adapters, as ``inject_adapters`` names them).
#: Adapter names are the peft model's keys without its ``base_model.model.`` prefix.
LoraExport = Literal["merged", "adapters", "with_base"]


def is_adapter_key(key: str) -> bool:
    """Whether a (peft) state-dict key is an adapter tensor (``lora_A``/``lora_B``)."""
    return ".lora_" in key


def base_layer_to_plain(key: str) -> str:
    """An adapted layer's weight under the plain HF name (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``); other keys unchanged."""
    return key.replace(".base_layer.", ".")


def _peft_config(config: LoraConfig):
    import peft

    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        # peft reads its "all-linear" shorthand only as a string, not as a module name
        target_modules=(
            "all-linear" if config.target_modules == ["all-linear"] else list(config.target_modules)
        ),
        task_type="CAUSAL_LM",
    )


def wrap_with_lora(model: PreTrainedModel, config: LoraConfig, seed: int) -> torch.nn.Module:
    """``model`` as a ``peft`` model whose only trainable parameters are the adapters.

    peft draws each ``lora_A`` from torch's global generator, which torch seeds at random in
    every process. Drawn from ``seed`` instead (in a forked generator, so the caller's random
    state is left as it was), two runs of one config start from the same adapters, and so do
    the ranks of one run. The stream is one of its own: a model initialised from the same
    seed (``init_weights_by_module``) would otherwise give its adapters the numbers of its
    embedding. ``model`` is on the CPU (peft draws there).
    """
    import peft

    from rl_models.modeling.random_streams import ADAPTER_STREAM, row_seed, seeded_generators

    with seeded_generators(row_seed(seed, ADAPTER_STREAM)):
        return peft.get_peft_model(model, _peft_config(config))


def inject_adapters(model: torch.nn.Module, config: LoraConfig) -> None:
    """Add ``config``'s adapters to ``model`` in place (a generator that receives adapters).

    The model stays a plain ``transformers`` model: each target linear becomes a peft LoRA layer
    whose ``base_layer`` holds the weight, so its keys are the training peft model's without
    the ``base_model.model.`` prefix. The adapters start as peft starts them (B = 0: the model's
    outputs are unchanged) and take the base weight's dtype; a refit then overwrites them.
    """
    import peft

    peft.inject_adapter_in_model(_peft_config(config), model, adapter_name=ADAPTER_NAME)
    base = next(p for n, p in model.named_parameters() if not is_adapter_key(n))
    for name, param in model.named_parameters():
        if is_adapter_key(name):
            param.data = param.data.to(base.dtype)


def lora_scalings(model: torch.nn.Module) -> dict[str, float]:
    """``{module name (peft naming): alpha / rank}`` of every adapted layer of ``model``."""
    from peft.tuners.lora import LoraLayer

    return {
        name: float(module.scaling[ADAPTER_NAME])
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.scaling
    }


def merged_state_dict(
    full: dict[str, torch.Tensor], scalings: dict[str, float]
) -> dict[str, torch.Tensor]:
    """The plain HF state dict of the merged model, from a peft model's full state dict.

    Each adapted ``base_layer.weight`` becomes ``W + scaling * B @ A`` (computed in at least
    float32, stored in ``W``'s dtype); adapter tensors are dropped and peft's prefixes removed.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        if is_adapter_key(key):
            continue
        name = key.removeprefix(_PEFT_PREFIX)
        module, _, leaf = key.rpartition(".")
        if module.endswith(".base_layer") and leaf == "weight":
            lora_module = module.removesuffix(".base_layer")
            a = full[f"{lora_module}.lora_A.{ADAPTER_NAME}.weight"]
            b = full[f"{lora_module}.lora_B.{ADAPTER_NAME}.weight"]
            dtype = torch.promote_types(value.dtype, torch.float32)
            delta = (b.to(dtype) @ a.to(dtype)) * scalings[lora_module]
            value = (value.to(dtype) + delta).to(value.dtype)
        out[base_layer_to_plain(name)] = value
    return out


def save_lora_checkpoint(model: torch.nn.Module, full: dict[str, torch.Tensor], path: str) -> None:
    """Write the merged HF model to ``path`` and the adapters to ``path/adapter`` (rank 0 only).

    ``model`` is the (possibly FSDP-sharded) peft model, used for its configs and the adapter
    scalings; ``full`` is its gathered full state dict.
    """
    model.save_pretrained(os.path.join(path, ADAPTER_DIR), state_dict=full)
    base = model.get_base_model()
    base.save_pretrained(path, state_dict=merged_state_dict(full, lora_scalings(model)))


def write_adapter_dir(
    directory: str, adapters: dict[str, torch.Tensor], config: LoraConfig
) -> None:
    """Write ``adapters`` to ``directory`` in peft's layout (``adapter_config.json``,
    ``adapter_model.safetensors``): what ``peft.PeftModel.from_pretrained`` and vLLM's
    ``LoRARequest`` read. Files already there are replaced.

    ``adapters`` are keyed as a refit exports them (``LoraExport``: the peft model's keys
    without its ``base_model.model.`` prefix, adapter name included); the file has peft's saved
    names (prefix, no adapter name). ``target_modules`` lists the adapted modules' names, so
    ``all-linear`` is written as the layers it covered.
    """
    from safetensors.torch import save_file

    tensors, targets = {}, set()
    for key, value in adapters.items():
        module, _, leaf = key.rpartition(".")  # "<layer>.lora_A.default", "weight"
        if not is_adapter_key(key) or not module.endswith(f".{ADAPTER_NAME}"):
            raise ValueError(
                f"{key!r} is not an adapter tensor named <layer>.lora_A|lora_B.{ADAPTER_NAME}"
                ".weight (policy.lora.LoraExport names)"
            )
        layer = key.split(".lora_")[0]
        targets.add(layer.rpartition(".")[2])
        # (a copy: safetensors refuses tensors that share memory, as views of one bucket do)
        saved = f"{_PEFT_PREFIX}{module.removesuffix(f'.{ADAPTER_NAME}')}.{leaf}"
        tensors[saved] = value.detach().to("cpu").contiguous().clone()
    peft_config = _peft_config(config)
    peft_config.target_modules = sorted(targets)
    os.makedirs(directory, exist_ok=True)
    peft_config.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))


def load_adapter_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The adapters saved under ``path/adapter``, keyed like the live peft model's parameters."""
    from peft.utils import load_peft_weights

    saved = load_peft_weights(os.path.join(path, ADAPTER_DIR), device="cpu")
    out = {}
    for key, value in saved.items():
        module, _, leaf = key.rpartition(".")  # "....lora_A.weight" -> "....lora_A.default.weight"
        out[f"{module}.{ADAPTER_NAME}.{leaf}"] = value
    return out
