"""Generation backends (vLLM, Hugging Face) behind one interface, and the weight-refit channel."""

from rl_models.generation.config import GenerationConfig, SamplingConfig, VllmConfig
from rl_models.generation.interfaces import GenerationInterface, StaleWeightsError

__all__ = [
    "GenerationConfig",
    "GenerationInterface",
    "SamplingConfig",
    "StaleWeightsError",
    "VllmConfig",
]
