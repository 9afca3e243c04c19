"""PPO with a learned critic: GRPO's rollouts, a value model's baseline, GAE.

    rl ppo --config examples/configs/ppo_math_cpu.yaml ppo.max_num_steps=20

- ``config.py``: ``MasterConfig`` (NeMo RL's PPO key names where it has them);
- ``gae.py``: token-level rewards, GAE, whitening, explained variance;
- ``loop.py``: ``setup``, the loop ``ppo_train`` and ``main``.

The critic is a value model (``rl_models``' policy worker with ``model.kind: value``) in its
own worker group, trained with ``losses.ClippedValueLossFn``; by default it starts from the
policy's model with a fresh value head and shares the policy's bundles.
"""

from rl_algorithms.ppo.config import DEFAULT_RECIPE, MAIN_RECIPE, MasterConfig
from rl_algorithms.ppo.loop import PHASES, main, ppo_train, setup

__all__ = ["DEFAULT_RECIPE", "MAIN_RECIPE", "PHASES", "MasterConfig", "main", "ppo_train", "setup"]
