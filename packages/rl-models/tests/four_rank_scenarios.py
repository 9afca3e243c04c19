"""Run by ``test_four_ranks.py`` under ``torch.distributed.run`` with four gloo ranks: the
DTensor worker on a two-dimensional ``dp x tp = 2 x 2`` mesh and on a three-dimensional
``dp x cp x tp = 1 x 2 x 2`` one. Each rank saves what it computed to ``<out>/rank<r>.pt``,
as ``two_rank_scenarios.py`` does.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import skewed_batch, tiny_config
from two_rank_scenarios import context_parallel_config, long_documents, test_module

from rl_models.losses import LabelSmoothedNLLLoss, NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.forward import TokenLogprobs

#: The meshes' cases: the skewed batch on dp x tp, the packed long documents on cp x tp.
CASES = ("dp2-tp2-sp", "cp2-tp2-sp")
#: The label smoothing of the losses over whole logits: not 0, so the loss's value also
#: depends on every vocabulary entry's log-probability (its mean), not only the target's.
SMOOTHING = 0.1


def case_config(case: str, parallel: bool = True):
    """A case's config (``parallel=False``: the same in one process). The three-dimensional
    mesh's case also clips its gradients (its norm is ~1.6) and writes each rank's own shards
    of the checkpoint."""
    if case == "cp2-tp2-sp":
        sharded = {"checkpoint": {"sharded": True}} if parallel else {}
        tp = 2 if parallel else 1
        return context_parallel_config(cp=parallel, tp=tp, max_grad_norm=0.5, **sharded)
    dtensor = {"tensor_parallel_size": 2, "sequence_parallel": True}
    return tiny_config(
        logprob_chunk_size=7,
        dynamic_batching={"enabled": False},
        **({"dtensor": dtensor} if parallel else {}),
    )


def case_data(case: str):
    return long_documents() if case == "cp2-tp2-sp" else skewed_batch()


def mesh_step(case: str, out: str) -> dict:
    """Log-probs with entropies and a loss over whole logits (evaluated), then one SGD step
    (NLL): its gradient norm, the weights exported in buckets (a refit's) and the checkpoint
    it writes (read back by rank 0). On cp x tp, also the gradient norm of a step through
    whole logits, whose gradient flows back through the gather over tp, then over cp.
    With dp = 2 each dp rank (two consecutive ranks) gets half of the rows, as the driver
    shards them; with cp every rank gets the whole batch."""
    rank = int(os.environ["RANK"])
    data = case_data(case)
    if case.startswith("dp2"):
        half = data.size // 2
        data = data.slice((rank // 2) * half, (rank // 2 + 1) * half)
    worker = DTensorPolicyWorker(case_config(case))
    with torch.no_grad():
        logprobs_entropy = worker._per_row(worker.model, data, TokenLogprobs(entropy=True))
    whole_logits_loss = worker.train(data, LabelSmoothedNLLLoss(SMOOTHING), eval_mode=True)
    whole_logits_grad_norm = None
    if case == "cp2-tp2-sp":  # a step through whole logits, on weights of its own
        logits_worker = DTensorPolicyWorker(case_config(case))
        step = logits_worker.train(data, LabelSmoothedNLLLoss(SMOOTHING))
        whole_logits_grad_norm = step.metrics["grad_norm"]
        del logits_worker
    grad_norm = worker.train(data, NLLLoss()).metrics["grad_norm"]
    weights, _ = test_module("test_weight_export").exported(
        [worker._weight_exporter()], bucket_bytes=1 << 14
    )
    path = os.path.join(out, f"checkpoint-{case}")
    worker.save_checkpoint(path)
    saved = {}
    if rank == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    return {
        "logprobs_entropy": logprobs_entropy,
        "whole_logits_loss": whole_logits_loss.metrics["loss"],
        "whole_logits_grad_norm": whole_logits_grad_norm,
        "grad_norm": grad_norm,
        "exported": weights,
        "checkpoint": saved,
    }


def main(out: str) -> None:
    """Every case runs even if another fails; a failure is saved as its message."""
    rank = int(os.environ["RANK"])
    results: dict = {}
    for case in CASES:
        try:
            results[case] = mesh_step(case, out)
        except Exception as e:
            results[case] = f"{type(e).__name__}: {e}"
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
