"""The parallel layout a Megatron checkpoint's optimiser state was saved under.

Why: the weights of a Megatron checkpoint are whole HF tensors and load under any layout, but
the optimiser state is one file per tensor-, pipeline- and expert-parallel rank
(``optimizer-pp{p}-tp{t}-ep{e}.pt``), each holding the state of that rank's shards. Resuming
under other sizes would find no file for some ranks, or a file whose parameter groups do not
match, and fail deep in torch. The saving run writes its sizes here (``LAYOUT_FILE`` in the
training-state directory), and a resume compares them with its own first, naming the config
keys that differ. Pure Python, so it is tested without launching ranks.
"""

from __future__ import annotations

import json
import os

LAYOUT_FILE = "megatron_parallel.json"

#: The sizes that split the optimiser state, by their key under ``policy.megatron``.
SIZE_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size")


def save_parallel_layout(state_dir: str, sizes: dict[str, int]) -> None:
    """Record ``sizes`` (``SIZE_KEYS``) beside the optimiser state in ``state_dir``."""
    with open(os.path.join(state_dir, LAYOUT_FILE), "w") as f:
        json.dump({key: int(sizes[key]) for key in SIZE_KEYS}, f, indent=1)


def check_parallel_layout(state_dir: str, sizes: dict[str, int], optimizer_file: str) -> None:
    """Refuse to resume from ``state_dir`` under other parallel sizes than it was saved with
    (``ValueError`` naming each ``policy.megatron`` key, the checkpoint's value and this run's).

    A checkpoint saved before the sizes were recorded is checked by its files: this rank's
    ``optimizer_file`` must exist (``FileNotFoundError`` saying what it means otherwise).
    """
    path = os.path.join(state_dir, LAYOUT_FILE)
    if not os.path.exists(path):
        if not os.path.exists(os.path.join(state_dir, optimizer_file)):
            raise FileNotFoundError(
                f"the checkpoint's training state {state_dir} has no {optimizer_file} for this "
                "rank: it was saved under other policy.megatron parallel sizes "
                f"({', '.join(SIZE_KEYS)}) than this run's {_sizes_text(sizes)}"
            )
        return
    with open(path) as f:
        saved = json.load(f)
    differ = [key for key in SIZE_KEYS if int(saved.get(key, 1)) != int(sizes[key])]
    if differ:
        changes = "; ".join(
            f"policy.megatron.{key}: checkpoint {saved.get(key, 1)}, this run {sizes[key]}"
            for key in differ
        )
        raise ValueError(
            f"cannot resume from {state_dir}: its optimiser state is split per parallel rank "
            f"and was saved under other sizes ({changes}). Resume with the checkpoint's sizes, "
            "or start a new run from its weights alone (policy.model.path), which load under "
            "any layout"
        )


def _sizes_text(sizes: dict[str, int]) -> str:
    return ", ".join(f"{key}={sizes[key]}" for key in SIZE_KEYS)
