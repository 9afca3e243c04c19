"""Checkpoints of a (possibly FSDP2-sharded) Hugging Face policy.

Both layouts hold Hugging Face safetensors weights plus ``config.json`` in ``path`` (loadable by
``from_pretrained`` with no code of ours), and the optimiser and scheduler state in the
training-state directory (``path`` itself unless one is given: a run's checkpoint keeps its model
folder clean and puts them beside it, see ``rl_algorithms.utils.checkpoint``):

- **full**: rank 0 gathers whole state dicts and writes ``model.safetensors`` and
  ``optimizer.pt``. Simple; needs the whole model in one host's memory.
- **sharded**: every rank writes only its own shards through ``torch.distributed.checkpoint``:
  the weights with the Hugging Face storage writer (shards under ``path/sharded``, then
  consolidated into whole-tensor safetensors files in ``path``), the optimiser state as a DCP
  checkpoint in ``optimizer/``. Loading reads each rank's slices straight from those files,
  so a run may resume on a different number of ranks.

``load`` tells the layouts apart by what is in the training-state directory.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PreTrainedModel

OPTIMIZER_FILE = "optimizer.pt"  # full layout
OPTIMIZER_DIR = "optimizer"  # sharded layout (a DCP checkpoint)
SCHEDULER_FILE = "scheduler.pt"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_full_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state_dir: str, rank: int
) -> dict[str, torch.Tensor]:
    """Write the gathered optimiser state on rank 0 into ``state_dir``; return the gathered
    weights (all ranks)."""
    weights = get_model_state_dict(model, options=FULL)
    optim = get_optimizer_state_dict(model, optimizer, options=FULL)
    if rank == 0:
        os.makedirs(state_dir, exist_ok=True)
        torch.save(optim, os.path.join(state_dir, OPTIMIZER_FILE))
    return weights


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str,
    state_dir: str,
    rank: int,
) -> None:
    """Every rank writes its shards of the weights (into ``path``) and of the optimiser state
    (into ``state_dir``): collective."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    os.makedirs(path, exist_ok=True)
    writer = HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=True)
    dcp.save(get_model_state_dict(model), storage_writer=writer)
    optim = get_optimizer_state_dict(model, optimizer)
    dcp.save({"optimizer": optim}, checkpoint_id=os.path.join(state_dir, OPTIMIZER_DIR))
    if rank == 0:
        hf: PreTrainedModel = model  # FSDP2 keeps the module's class and attributes
        # The config in memory still names the class its files were written by: a reward
        # model or critic built from a causal LM's files would read back as a causal LM to
        # vLLM or any other reader. Name the class these weights belong to, as
        # ``save_pretrained`` does.
        hf.config.architectures = [_model_class(hf).__name__]
        hf.config.save_pretrained(path)
        if getattr(hf, "generation_config", None) is not None:
            hf.generation_config.save_pretrained(path)


def _model_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2 puts a subclass of ``FSDPModule`` in front of it."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def save_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, state_dir: str) -> None:
    os.makedirs(state_dir, exist_ok=True)
    torch.save(scheduler.state_dict(), os.path.join(state_dir, SCHEDULER_FILE))


def is_sharded(state_dir: str) -> bool:
    return os.path.isdir(os.path.join(state_dir, OPTIMIZER_DIR))


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, state_dir: str
) -> None:
    """Read this rank's slices of a sharded checkpoint into ``model`` and ``optimizer``."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    weights = get_model_state_dict(model)
    dcp.load(weights, storage_reader=HuggingFaceStorageReader(path))
    set_model_state_dict(model, weights)
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=os.path.join(state_dir, OPTIMIZER_DIR))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_full_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state_dir: str
) -> None:
    optim = torch.load(os.path.join(state_dir, OPTIMIZER_FILE), weights_only=False)
    if not optim.get("state"):
        # A stateless optimiser (plain SGD): torch's loader cannot place an empty state, and
        # the hyper-parameters come from the config anyway.
        return
    set_optimizer_state_dict(
        model, optimizer, optim, options=StateDictOptions(full_state_dict=True)
    )


def load_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, state_dir: str) -> None:
    scheduler.load_state_dict(torch.load(os.path.join(state_dir, SCHEDULER_FILE)))
