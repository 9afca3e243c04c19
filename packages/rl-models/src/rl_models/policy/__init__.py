"""Policies: a typed config, the DTensor (FSDP2) worker and the controller that drives them."""

from rl_models.policy.config import PolicyConfig

__all__ = ["PolicyConfig"]
