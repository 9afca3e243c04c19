"""Megatron-core policy backend.

``convert`` (HF <-> Megatron weights) is pure torch and imports anywhere. ``worker`` and
``cpu_shim`` import ``megatron.core``, which lives only in the isolated ``mcore`` worker
environment (the root workspace's ``mcore`` extra), not in the driver: the backend's
registration (``rl_models.policy.config``, imported here) runs every class under
``rl_models.megatron`` in that environment, so
``RayWorkerBuilder("rl_models.megatron.worker.MegatronPolicyWorker", ...)`` needs nothing else.
"""

import rl_models.policy.config  # noqa: F401  (registers the megatron backend)
