"""Checkpoints of a training run that a crash can never corrupt, and automatic resume.

Layout of ``checkpoint_dir``::

    step_40/                 a complete checkpoint (only complete ones have this name)
        policy/              the policy as a Hugging Face model: weights, config, tokenizer
                             (``from_pretrained`` loads the folder as it is)
        critic/              models trained beside the policy (PPO's critic), the same way
        optimizer_state/
            policy/          the policy's optimiser and learning-rate scheduler state
            critic/          and each other model's
        training_state.pt    step, policy weight version, data-loader position, RNG states,
                             extra state
        info.json            step, metrics and the run's identity: its algorithm, loss,
                             model, tokenizer and data (written last, before the rename)
    .tmp-step_60-1234/       being written (or left by a killed run): never loaded

A checkpoint is written into a hidden temporary directory and renamed to ``step_<n>`` only
when everything is on disk, so a run killed mid-write leaves nothing that resume picks up;
leftover temporaries are removed when the next run opens the directory. After each save the
latest checkpoint and the ``keep_top_k`` best by ``metric_name`` are kept.

A run with a wall-clock limit (``checkpoint_must_save_by``, or the end of the Slurm job that
``rl-cluster slurm``'s script passes in ``RL_CHECKPOINT_DEADLINE``) saves a checkpoint and stops
once its next step would end past the limit, so that the job ends with its work on disk.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from pydantic import Field, field_validator

from rl_distributed.config import ConfigModel
from rl_distributed.launchers import CHECKPOINT_DEADLINE_ENV

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
POLICY_DIR = "policy"
# Beside the model folders, so that each of those holds a model and nothing else. Checkpoints
# written before kept the optimiser and scheduler in the model folder; they still load.
OPTIMIZER_STATE_DIR = "optimizer_state"
STATE_FILE = "training_state.pt"
INFO_FILE = "info.json"
# Config keys that make a run what it is: a checkpoint directory written with other values
# belongs to another run, and resuming from it would silently mix the two. (Keys that a resumed
# run may change, such as the step limit, dtype or attention kernel, are not among them.)
IDENTITY_KEYS = (
    "policy.model.path",
    "policy.model.hf_config",
    "policy.model.kind",
    "tokenizer",
    "data.train",
    # Models trained or read beside the policy: a PPO checkpoint holds a critic a GRPO run
    # would drop, and a distillation run resumed with another teacher is another run.
    "critic.model.path",
    "critic.model.hf_config",
    "teacher.model.path",
    "teacher.model.hf_config",
)
# What makes a run what it is besides its config: the algorithm (``rl sft``, ``rl grpo``...) and
# the class of its loss (a loss's hyper-parameters may change on resume, not the loss). Recorded
# only when known; a checkpoint that records neither (written before they were) resumes as before.
RUN_KEYS = ("algorithm", "loss")


class CheckpointOfAnotherRun(ValueError):
    """``checkpoint_dir`` holds a checkpoint that this run must not resume from (nor write
    beside): another algorithm's, or one of another loss, model, tokenizer or data."""


class CheckpointingConfig(ConfigModel):
    """When and where checkpoints are written, and which are kept (NeMo RL's key names)."""

    # Write checkpoints (and resume from the latest one in checkpoint_dir).
    enabled: bool = True
    # Where checkpoints go, one step_N folder each; re-running with the same folder resumes.
    checkpoint_dir: str = "results/checkpoints"
    save_period: int = Field(10, ge=1)  # steps between checkpoints (and one at the end)
    # Keep the best k by metric_name, plus always the latest; None keeps every checkpoint.
    keep_top_k: int | None = Field(3, ge=1)
    metric_name: str | None = None  # e.g. "val/loss"; None ranks by step (the k newest)
    # Whether a larger metric_name is better when ranking checkpoints.
    higher_is_better: bool = False
    # Save and stop before this much time since the run started ("DD:HH:MM:SS"); None: no limit.
    # A job of `rl-cluster slurm` also sets RL_CHECKPOINT_DEADLINE: the earlier limit applies.
    checkpoint_must_save_by: str | None = None

    @field_validator("checkpoint_must_save_by")
    @classmethod
    def _is_a_duration(cls, value: str | None) -> str | None:
        if value is not None:
            duration_seconds(value)
        return value


def duration_seconds(text: str) -> int:
    """Seconds in NeMo RL's ``"DD:HH:MM:SS"``; leading fields may be left out (``"HH:MM:SS"``)."""
    fields = text.split(":") if isinstance(text, str) else []
    if not 1 <= len(fields) <= 4 or not all(f.strip().isdigit() for f in fields):
        raise ValueError(f"expected a duration as DD:HH:MM:SS (e.g. 00:03:30:00), got {text!r}")
    seconds = 0
    for value, unit in zip(reversed(fields), (1, 60, 3600, 86400), strict=False):
        seconds += int(value) * unit
    return seconds


def save_deadline(config: CheckpointingConfig, now: float) -> float | None:
    """The Unix time by which the run must have saved: the earlier of
    ``checkpoint_must_save_by`` (counted from ``now``) and ``RL_CHECKPOINT_DEADLINE``."""
    deadlines = []
    if config.checkpoint_must_save_by is not None:
        deadlines.append(now + duration_seconds(config.checkpoint_must_save_by))
    if value := os.environ.get(CHECKPOINT_DEADLINE_ENV):
        try:
            deadline = float(value)
            if not math.isfinite(deadline):
                raise ValueError
            deadlines.append(deadline)
        except ValueError:
            raise ValueError(
                f"{CHECKPOINT_DEADLINE_ENV}={value!r} is not a Unix time in seconds "
                "(rl-cluster slurm's script sets it to the job's end less a margin)"
            ) from None
    return min(deadlines, default=None)


class SupportsCheckpoint(Protocol):
    """A trained model's checkpoint: its weights into ``path``, its optimiser and scheduler
    state into ``training_state_dir`` (``path`` when None)."""

    def save_checkpoint(self, path: str, training_state_dir: str | None = None) -> None: ...
    def load_checkpoint(self, path: str, training_state_dir: str | None = None) -> None: ...


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rng_states() -> dict[str, Any]:
    """The controller's random generators (Python, NumPy, torch CPU and CUDA)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """Saves, prunes and finds checkpoints in ``config.checkpoint_dir``.

    ``algorithm`` (the ``rl`` command's name) and ``loss`` (the loss object the run trains
    with) are recorded in every checkpoint written with a ``run_config``, and a checkpoint
    of another algorithm or loss is refused by :meth:`check_resumable`."""

    def __init__(
        self,
        config: CheckpointingConfig,
        clock: Callable[[], float] = time.time,
        *,
        algorithm: str | None = None,
        loss: object | None = None,
    ) -> None:
        self.config = config
        self.algorithm = algorithm
        # The class name only: a loss whose module moved is still the same loss.
        self.loss = type(loss).__qualname__ if loss is not None else None
        self.root = Path(config.checkpoint_dir)
        self._clock = clock
        # Unix time, or None: no limit (and a disabled manager never reads the environment).
        self.deadline = save_deadline(config, clock()) if config.enabled else None
        # The first step is timed from here, so it counts too (with what ran before it, such
        # as validation at start: the first decision errs on the early side).
        self._last_step_end = clock()
        self._steps_timed = 0
        self._longest_step = 0.0
        self._longest_save = 0.0
        if config.enabled:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in self.root.glob(f"{TMP_PREFIX}*"):
                log.warning("removing incomplete checkpoint %s (a run stopped mid-write)", leftover)
                shutil.rmtree(leftover, ignore_errors=True)

    # -- finding -------------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest step first."""
        if not self.root.is_dir():
            return []
        found = [
            p
            for p in self.root.iterdir()
            if p.is_dir() and STEP_DIR.match(p.name) and (p / INFO_FILE).is_file()
        ]
        return sorted(found, key=_step_of)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def should_save(self, step: int, last_step: bool = False) -> bool:
        return self.config.enabled and (last_step or step % self.config.save_period == 0)

    def out_of_time(self) -> bool:
        """Whether the run must save now and stop, because another step and a checkpoint
        write would end past the deadline. Call it once at the end of every step: the longest
        time between two calls (a step with its validation and checkpoint write) is what the
        next step may take, the longest write so far what the final save may take."""
        now = self._clock()
        taken = now - self._last_step_end
        self._last_step_end = now
        # The first interval also holds what came before the first step: it stands in for a
        # step until one has been timed on its own, and is not kept as the longest.
        estimate = taken if self._steps_timed == 0 else max(self._longest_step, taken)
        if self._steps_timed > 0:
            self._longest_step = estimate
        self._steps_timed += 1
        if not self.config.enabled or self.deadline is None:
            return False
        return now + estimate + self._longest_save >= self.deadline

    # -- saving --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        policy: SupportsCheckpoint | None,
        *,
        dataloader: Stateful | None = None,
        models: Mapping[str, SupportsCheckpoint] | None = None,
        metrics: Mapping[str, float] | None = None,
        extra_state: Mapping[str, Any] | None = None,
        run_config: Mapping[str, Any] | None = None,
        tokenizer: Any | None = None,
    ) -> Path:
        """Write the checkpoint of ``step`` atomically and prune old ones; returns its path.

        ``run_config`` (the run's config as JSON-able data) has its ``IDENTITY_KEYS`` kept in
        ``info.json``, with the manager's algorithm and loss, so that resuming with another
        algorithm, loss, model, tokenizer or training data is refused.
        ``tokenizer`` is saved beside the policy's weights, so that ``transformers`` loads the
        checkpoint's ``policy`` directory as it is. ``models`` are saved beside the policy, each
        in the directory its key names (``critic``)."""
        started = self._clock()
        final = self.root / f"step_{step}"
        tmp = self.root / f"{TMP_PREFIX}step_{step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if policy is not None:
            policy.save_checkpoint(*_model_dirs(tmp, POLICY_DIR))
            if tokenizer is not None:  # the weights' directory is then a whole HF model
                tokenizer.save_pretrained(tmp / POLICY_DIR)
        for name, model in (models or {}).items():
            model.save_checkpoint(*_model_dirs(tmp, name))
        state = {
            "step": step,
            # The policy's weight version (optimiser steps so far): a generator seeds its
            # sampling from it (``rl_models.generation.seeds``), so a resumed run must go on
            # counting from it, not from 0.
            "policy_weight_version": getattr(policy, "weight_version", None),
            "rng": rng_states(),
            "dataloader": dataloader.state_dict() if dataloader is not None else None,
            "extra": dict(extra_state or {}),
        }
        torch.save(state, tmp / STATE_FILE)
        info: dict[str, Any] = {
            "step": step,
            "metrics": {k: float(v) for k, v in (metrics or {}).items()},
        }
        if run_config is not None:
            info["identity"] = run_identity(run_config, self.algorithm, self.loss)
        _write_synced(tmp / INFO_FILE, json.dumps(info, indent=1))
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. re-running a finished run)
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic: a reader sees the whole checkpoint or none
        _fsync_dir(self.root)
        self._prune()
        self._longest_save = max(self._longest_save, self._clock() - started)
        return final

    def _prune(self) -> None:
        k = self.config.keep_top_k
        found = self.checkpoints()
        if k is None or len(found) <= k:
            return
        latest = found[-1]
        keep = set(sorted(found, key=self._rank_key, reverse=True)[:k]) | {latest}
        for path in found:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def _rank_key(self, path: Path) -> tuple[int, float, int]:
        """Bigger is better: checkpoints missing the metric rank below all that have it."""
        if self.config.metric_name is None:
            return (1, 0.0, _step_of(path))
        value = read_info(path)["metrics"].get(self.config.metric_name)
        if value is None:
            return (0, 0.0, _step_of(path))
        return (1, value if self.config.higher_is_better else -value, _step_of(path))

    # -- resuming ------------------------------------------------------------------------------

    def check_resumable(self, path: Path, run_config: Mapping[str, Any]) -> None:
        """Refuse to resume from ``path`` if it was written by another algorithm, or with
        another loss, model, tokenizer or data (``RUN_KEYS``, ``IDENTITY_KEYS``); call it
        before any worker starts, so that this run never writes into another run's folder."""
        saved = read_info(path).get("identity")
        if saved is None:  # written without a config: nothing to compare
            return
        mine = run_identity(run_config, self.algorithm, self.loss)
        where = f"checkpointing.checkpoint_dir {str(self.root)!r}"
        theirs = saved.get("algorithm")
        if theirs is not None and mine.get("algorithm") not in (None, theirs):
            raise CheckpointOfAnotherRun(
                f"{where} holds a checkpoint of an `rl {theirs}` run ({path.name}), and this is "
                f"`rl {mine['algorithm']}`: use a new checkpoint_dir (to start from that run's "
                f"weights, set policy.model.path to {str(path / POLICY_DIR)!r})"
            )
        # A key that either side does not record (an older checkpoint) is not compared.
        differ = [
            key
            for key in (*RUN_KEYS, *IDENTITY_KEYS)
            if (key in IDENTITY_KEYS or (key in saved and key in mine))
            and saved.get(key) != mine.get(key)
        ]
        if differ:
            details = "; ".join(
                f"{key}: checkpoint {saved.get(key)!r}, this run {mine.get(key)!r}"
                for key in differ
            )
            raise CheckpointOfAnotherRun(
                f"{where} holds a checkpoint of another run ({path.name}: {details}); use a new "
                "checkpoint_dir, or the same config to resume"
            )

    def load(
        self,
        path: Path,
        policy: SupportsCheckpoint | None,
        *,
        dataloader: Stateful | None = None,
        models: Mapping[str, SupportsCheckpoint] | None = None,
        restore_rng: bool = True,
    ) -> dict[str, Any]:
        """Restore a checkpoint into ``policy``, ``models`` and ``dataloader`` (and the RNGs).

        Returns ``{"step", "extra", "metrics"}``: the step to continue after and the extra
        state saved with it.
        """
        state = torch.load(path / STATE_FILE, weights_only=False)  # our own file
        if policy is not None:
            policy.load_checkpoint(*_model_dirs(path, POLICY_DIR, saved=True))
            version = state.get("policy_weight_version")
            # Version 0 names the initial weights, which every generator starts with: a policy
            # restored to a checkpoint keeps a version of its own then (the one loading gave
            # it), so that the generator is refit with the checkpoint's weights all the same.
            if version and hasattr(policy, "weight_version"):
                policy.weight_version = version
        for name, model in (models or {}).items():
            if not (path / name).is_dir():
                raise ValueError(
                    f"checkpoint {path} has no {name}/ directory: it was written by a run "
                    f"without a {name}, so this run cannot resume from it"
                )
            model.load_checkpoint(*_model_dirs(path, name, saved=True))
        if dataloader is not None and state["dataloader"] is not None:
            dataloader.load_state_dict(state["dataloader"])
        if restore_rng:
            set_rng_states(state["rng"])
        return {"step": state["step"], "extra": state["extra"], **read_info(path)}


def _model_dirs(checkpoint: Path, name: str, saved: bool = False) -> tuple[str, str | None]:
    """Where model ``name`` of a checkpoint keeps its weights and its optimiser state. A
    checkpoint ``saved`` before the optimiser state moved out of the model folder has no
    ``optimizer_state/<name>``: None then, which reads it from the model folder."""
    state, model = checkpoint / OPTIMIZER_STATE_DIR / name, checkpoint / name
    if saved and not state.is_dir():
        log.info("%s: the optimiser state is read from the model folder (older layout)", model)
        return str(model.resolve()), None
    return str(model.resolve()), str(state.resolve())


def run_identity(
    run_config: Mapping[str, Any], algorithm: str | None = None, loss: str | None = None
) -> dict[str, Any]:
    """The ``IDENTITY_KEYS`` sections of a config dump (``None`` where absent), with the
    ``algorithm`` and ``loss`` class name (``RUN_KEYS``) where they are known."""
    out: dict[str, Any] = {
        key: value for key, value in zip(RUN_KEYS, (algorithm, loss), strict=True) if value
    }
    for key in IDENTITY_KEYS:
        node: Any = run_config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        out[key] = node
    return out


def read_info(path: Path) -> dict[str, Any]:
    return json.loads((path / INFO_FILE).read_text(encoding="utf-8"))


def _step_of(path: Path) -> int:
    match = STEP_DIR.match(path.name)
    assert match is not None
    return int(match.group(1))


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # Make the rename itself durable: a power cut after it must not undo it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
