"""PPO with a learned critic: token-level rewards, GAE advantages and returns (``gae``)."""
