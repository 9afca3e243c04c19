"""On-policy distillation: the student samples, a frozen teacher scores every sampled token,
the student minimises a per-token divergence to the teacher on its own samples.

    rl distill --config examples/configs/distill_math_cpu.yaml

- ``config.py``: ``MasterConfig`` (NeMo RL's distillation key names);
- ``loop.py``: ``setup``, the loop ``distill_train`` and ``main``.

The losses are ``losses.DistillationLossFn`` (reverse KL on sampled tokens, or forward /
reverse / mixed / JSD divergences over the teacher's top-k); the teacher is a policy worker
group that never trains (``actors.make_teacher``).
"""

from rl_algorithms.distill.config import DEFAULT_RECIPE, MasterConfig
from rl_algorithms.distill.loop import PHASES, distill_train, main, setup

__all__ = ["DEFAULT_RECIPE", "PHASES", "MasterConfig", "distill_train", "main", "setup"]
