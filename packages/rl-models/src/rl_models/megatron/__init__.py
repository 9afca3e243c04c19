"""Megatron-core policy backend.

``convert`` (HF <-> Megatron weights), ``loading`` and ``weight_export`` are pure torch and
import anywhere; what they convert is read off one table per model family (``family``,
``families/``). ``worker`` and ``cpu_shim`` import ``megatron.core``, which lives only in the
isolated ``mcore`` worker environment (the root workspace's ``mcore`` extra), not in the driver:
the backend's registration (``rl_models.policy.config``, imported here) runs every class under
``rl_models.megatron`` in that environment, so
``RayWorkerBuilder("rl_models.megatron.worker.MegatronPolicyWorker", ...)`` needs nothing else.
"""

import rl_models.policy.config  # noqa: F401  (registers the megatron backend)
