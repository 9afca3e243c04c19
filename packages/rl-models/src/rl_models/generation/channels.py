"""Moved to ``rl_models.weight_transfer.channels``; this name is kept only until
``generation/vllm/`` imports from there (then delete this module)."""

from rl_models.weight_transfer.channels import ChannelReceiver  # noqa: F401 (for generation/vllm/)
