"""Generation backends (vLLM, Hugging Face, any registered one: ``rl_models.backends``) behind
one interface, and the weight-refit channel.

``HfGeneration`` (``rl_models.generation.hf_generation``) and ``refit``
(``rl_models.generation.refit``) import Ray worker-group machinery; import them from their
modules.
"""

from rl_models.generation.config import (
    GenerationConfig,
    HfGenerationConfig,
    SamplingConfig,
    VllmConfig,
    VllmGenerationConfig,
)
from rl_models.generation.interfaces import (
    GenerationInterface,
    GenerationWorker,
    IncompleteRefitError,
    RequestAbortedError,
    StaleWeightsError,
    WeightExportWorker,
)
from rl_models.generation.streaming import StreamingGeneration, StreamingSampler, StreamNews

__all__ = [
    "GenerationConfig",
    "GenerationInterface",
    "GenerationWorker",
    "HfGenerationConfig",
    "IncompleteRefitError",
    "RequestAbortedError",
    "SamplingConfig",
    "StaleWeightsError",
    "StreamNews",
    "StreamingGeneration",
    "StreamingSampler",
    "VllmConfig",
    "VllmGenerationConfig",
    "WeightExportWorker",
]
