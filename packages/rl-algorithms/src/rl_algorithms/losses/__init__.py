"""Loss functions (``rl_models.interfaces.LossFunction``) of the training algorithms.

``NLLLoss`` (SFT) is rl-models' own; the others live here. See each module for the batch keys
it reads. Metrics follow the convention of ``common.py``: additive, or ``Min`` / ``Max``.
"""

from rl_algorithms.losses.clipped_pg import ClippedPGLossConfig, ClippedPGLossFn, kl_estimate
from rl_algorithms.losses.distillation import DistillationLossConfig, DistillationLossFn
from rl_algorithms.losses.dpo import DPOLoss, DPOLossConfig
from rl_algorithms.losses.preference import BradleyTerryLoss
from rl_algorithms.losses.value import ClippedValueLossFn, ValueLossConfig
from rl_models.losses import NLLLoss

__all__ = [
    "BradleyTerryLoss",
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "ClippedValueLossFn",
    "DPOLoss",
    "DPOLossConfig",
    "DistillationLossConfig",
    "DistillationLossFn",
    "NLLLoss",
    "ValueLossConfig",
    "kl_estimate",
]
