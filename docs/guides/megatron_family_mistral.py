"""Mistral on the Megatron backend: save as rl_models/megatron/families/mistral.py."""

from typing import Any

from rl_models.megatron.families.llama import LAYER
from rl_models.megatron.family import ModelFamily


def _check(config: Any) -> None:
    # Megatron's attention here is causal over the whole sequence: a model trained with a
    # sliding window (Mistral 7B v0.1) would compute something else past the window.
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError("Mistral with sliding_window is not supported (v0.2 and later have none)")


# Mistral's checkpoints name their weights as Llama's do, and the layer is the same.
FAMILY = ModelFamily("mistral", model_types=("mistral",), layer=LAYER, check_config=_check)
