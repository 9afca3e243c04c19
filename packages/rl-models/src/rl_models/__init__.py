"""Policy backends: the policy interface, losses, and the DTensor (FSDP2) policy for HF models.

``rl_models.policy.lm_policy.Policy`` drives a Ray group of
``rl_models.policy.dtensor_worker.DTensorPolicyWorker``; submodules are imported on use so that
``import rl_models`` stays light.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rl-models")
except PackageNotFoundError:  # on sys.path (PYTHONPATH=.../src), not installed: bench/gpu_check.py
    __version__ = "0+linked"
