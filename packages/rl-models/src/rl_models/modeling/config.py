"""The model a policy or a generator holds, as configured: a local Hugging Face directory (or
GGUF file) or an HF config to build fresh weights from."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from rl_distributed.config import ConfigModel

DType = Literal["float32", "float64", "bfloat16", "float16"]


class ModelConfig(ConfigModel):
    """Either a local Hugging Face model directory or an HF config to build fresh weights from."""

    # A local Hugging Face model directory (or a folder holding gguf_file); None with hf_config
    # builds fresh weights.
    path: str | None = None
    # A GGUF file inside `path` (or an absolute path): converted once to safetensors in a cache
    # (rl_models.model_files) that every worker and vLLM then load as an HF directory.
    gguf_file: str | None = None
    # e.g. {"model_type": "llama", "hidden_size": 64, ...}; weights are initialised from `seed`.
    hf_config: dict[str, Any] | None = None
    # The weights' dtype (the master weights when mixed_precision is on).
    dtype: DType = "float32"
    # "sequence_classification": a reward model, AutoModelForSequenceClassification with
    # `num_labels` scores read at each sequence's last real token. "value": a critic,
    # AutoModelForTokenClassification with one output per token (the state's value) on the
    # same backbone; built from a causal LM's weights, its value head starts fresh from `seed`.
    kind: Literal["causal_lm", "sequence_classification", "value"] = "causal_lm"
    # Scores per sequence of a sequence_classification model (a reward model has 1).
    num_labels: int = Field(1, ge=1)
    # Hugging Face attention kernel. "sdpa" takes our dense block-diagonal masks for packed rows;
    # "flash_attention_2"/"flash_attention_3" (GPU) run packed rows as variable-length
    # sequences found from position ids, with no [T, T] mask at all.
    attn_implementation: Literal[
        "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"
    ] = "sdpa"

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None and self.gguf_file is None) == (self.hf_config is None):
            raise ValueError(
                "give exactly one of model.path (or model.gguf_file) and model.hf_config"
            )
        if self.hf_config is not None and "model_type" not in self.hf_config:
            raise ValueError("model.hf_config needs a 'model_type' (e.g. 'llama')")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)
