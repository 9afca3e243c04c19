"""The shared shape of single-turn environments whose reward comes from a verifier function.

Subclasses name the verifier (an importable ``"module:function"`` returning
``(reward, extracted answer)``) and turn each conversation and its metadata into the verifier's
arguments; the :class:`~rl_envs.pool.WorkerPool` runs it. A sample whose arguments cannot even
be built (its metadata lacks the ground truth, say) costs that sample, like a verifier error.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from pydantic import Field

from rl_data.types import MessageLog
from rl_distributed.config import ConfigModel
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn, check_required_metadata
from rl_envs.metrics import OutcomeCounts, reward_metrics
from rl_envs.pool import Outcome, WorkerPool


class VerifierEnvConfig(ConfigModel):
    # Verifier worker processes scoring samples in parallel; null: as many as the CPUs Ray has
    # free once the trainer and generator have theirs, at most 2.
    num_workers: int | None = Field(None, ge=1)
    # Ray CPUs reserved per verifier worker.
    num_cpus_per_worker: float = 1.0
    timeout_s: float = 10.0  # per sample
    # Samples per worker call; None: about a quarter of a worker's share, and at least 4 when
    # every worker still gets some (see rl_envs.pool.chunk_ranges). 1 balances slow,
    # uneven verifiers best (the code and tool environments' default); more saves calls on
    # cheap ones.
    chunk_size: int | None = Field(None, ge=1)
    # The k of the pass@k metrics reported at validation.
    pass_at_k: list[int] = [1]
    success_threshold: float = 1.0  # reward at which a sample counts as correct


class VerifierEnvironment(EnvironmentInterface):
    verifier: ClassVar[str]  # "module:function" -> (reward, answer)
    preload: ClassVar[tuple[str, ...]] = ()  # heavy modules the verifier imports

    def __init__(self, cfg: VerifierEnvConfig) -> None:
        self.cfg = cfg
        self.counts = OutcomeCounts()
        self._pool = WorkerPool(
            self.verifier,
            num_workers=cfg.num_workers,
            timeout_s=cfg.timeout_s,
            chunk_size=cfg.chunk_size,
            num_cpus_per_worker=cfg.num_cpus_per_worker,
            preload=self.preload,
        )

    @abstractmethod
    def verifier_args(self, message_log: MessageLog, metadata: Mapping[str, Any]) -> tuple:
        """The verifier's arguments for one sample."""

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        check_required_metadata(self, metadata)  # a missing answer column is no 0 reward
        outcomes: list[Outcome | None] = [None] * len(message_log_batch)
        jobs: list[tuple] = []
        job_index: list[int] = []
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True)):
            try:
                jobs.append(self.verifier_args(log, meta))
                job_index.append(i)
            except Exception as e:
                outcomes[i] = Outcome("error", error=f"bad sample: {type(e).__name__}: {e}")
        for i, outcome in zip(job_index, self._pool.map(jobs), strict=True):
            outcomes[i] = outcome
        rewards, answers, observations = [], [], []
        for outcome in outcomes:
            assert outcome is not None
            self.counts.add(outcome.status)
            reward, answer = 0.0, None
            if outcome.status == "ok":
                try:
                    reward, answer = float(outcome.value[0]), outcome.value[1]
                except Exception:  # a verifier returning nonsense is a verifier error
                    self.counts.verifier_errors += 1
            rewards.append(reward)
            answers.append(answer)
            text = (
                f"reward {reward:g}" if outcome.status == "ok" else f"not scored: {outcome.status}"
            )
            observations.append({"role": "environment", "content": text})
        n = len(outcomes)
        return EnvironmentReturn(
            observations=observations,
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        metrics = reward_metrics(
            batch["rewards"],
            batch.get("group_ids"),
            ks=self.cfg.pass_at_k,
            success_threshold=self.cfg.success_threshold,
        )
        # Timeouts and errors are counted as steps see them, since the last metrics call.
        return batch, {**metrics, **self.counts.take()}

    def shutdown(self) -> None:
        self._pool.shutdown()
