"""Reward metrics: mean reward, accuracy, pass@k, and counts of timeouts and verifier errors."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples is correct) from n samples, c correct.

    ``1 - C(n-c, k) / C(n, k)``, computed as a product so that no huge binomial is formed.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def grouped_pass_at_k(correct: Sequence[bool], group_ids: Sequence, k: int) -> float | None:
    """Mean pass@k over groups (samples of one prompt); groups of fewer than k samples are left
    out. None when no group has k samples."""
    groups: dict[object, list[bool]] = defaultdict(list)
    for ok, gid in zip(correct, group_ids, strict=True):
        groups[gid].append(bool(ok))
    values = [pass_at_k(len(g), sum(g), k) for g in groups.values() if len(g) >= k]
    return sum(values) / len(values) if values else None


def reward_metrics(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence | torch.Tensor | None = None,
    ks: Iterable[int] = (1,),
    success_threshold: float = 1.0,
) -> dict[str, float]:
    """``reward_mean``, ``accuracy`` (fraction with reward >= ``success_threshold``) and, with
    ``group_ids``, ``pass@k`` for every k no larger than some group."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() == 0:
        return {}
    correct = (r >= success_threshold).tolist()
    out = {"reward_mean": r.mean().item(), "accuracy": sum(correct) / len(correct)}
    if group_ids is not None:
        gids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
        for k in ks:
            value = grouped_pass_at_k(correct, gids, k)
            if value is not None:
                out[f"pass@{k}"] = value
    return out


@dataclass
class OutcomeCounts:
    """What happened to scored samples since the counts were last taken."""

    samples: int = 0
    timeouts: int = 0
    verifier_errors: int = 0

    def add(self, status: str) -> None:
        self.samples += 1
        self.timeouts += status == "timeout"
        self.verifier_errors += status == "error"

    def take(self) -> dict[str, float]:
        """The counts, as metrics, and start again from zero."""
        out = {f.name: float(getattr(self, f.name)) for f in fields(self)}
        self.samples = self.timeouts = self.verifier_errors = 0
        return out
