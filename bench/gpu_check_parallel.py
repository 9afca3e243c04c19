"""The policy's training checks of ``bench/gpu_check.py``: one for each way its ranks split the
work, each held against the same float64 reference.

gpu_check's policy ranks run, at world size ``w``:

1. data parallel (FSDP2): the batch's rows split evenly over the ``w`` ranks (``check_rows``);
2. tensor parallel, ``tp = w`` with sequence parallelism: every rank is given the whole batch;
   each decoder layer's matrices, the embedding and the output layer are split over the ranks,
   the activations between blocks along the sequence, and log-probs come from the vocabulary
   slices. Only where ``w`` > 1: at world size 1, ``tp = 1`` is check 1's configuration
   exactly, and the config refuses sequence parallelism without ``tp`` > 1;
3. context parallel, ``cp = w``: the batch's rows packed into one long row; every rank is
   given it, runs its share of the tokens (the all-gather-KV attention of
   ``rl_models/policy/context_parallel.py``) and gets the log-probs back whole. At world size 1
   the packed row runs unsplit (``cp = 1``): the baseline for ``w = 2``. A third check holds
   rank 0's training forward to one pass over its share of the row.

Each gives chunked log-probs and one bf16 training step (SGD, no clipping: the update is
``-lr * gradient``), held against a plain transformers model in float64 on the CPU
(``log_softmax``, ``gather``, autograd) from the case's own initial weights. Every case is
built from the same seed, so that reference is computed once and reused while the initial
weights are equal bit for bit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.losses import NLLLoss
from rl_models.policy.checkpoint import FULL
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

if TYPE_CHECKING:
    from gpu_check import Report, Setup

LR = 0.5  # SGD's step: big enough that the update stands far above float32 rounding
# bfloat16 keeps 8 significant bits, so every product and partial sum of the bf16 forward and
# backward is off by up to ~2**-9 of its size. On the CPU (micro and tiny models, 2 and 4
# layers) the errors stay far below these bounds (docs/gpu-results.md has them); the headroom
# is for qwen2-0.5b's 24 layers of bf16 rounding, not yet measured on a GPU. What the checks are
# for shows far above them: a wrong mask, a shifted token or a missing gradient reduction gives
# log-prob errors of order 1 and update errors of tens of percent.
BF16_LOGPROB_MAX, BF16_LOGPROB_MEAN = 0.15, 0.03  # |log-prob error|, nats
BF16_LOSS_REL, BF16_GRAD_NORM_REL, BF16_UPDATE_REL = 0.01, 0.05, 0.08


@dataclass(frozen=True)
class Case:
    """A tensor- or context-parallel layout of the policy at one world size, all of it one
    model-parallel group (no data parallelism): every rank is given the whole batch."""

    name: str  # in the result file's name
    label: str  # in the check lines
    dtensor: dict[str, Any]  # the config's ``dtensor`` section
    packed: bool


def cases(world: int) -> list[Case]:
    found = []
    if world > 1:
        found.append(
            Case(
                "tp",
                f"tp={world}, sequence parallel",
                {"tensor_parallel_size": world, "sequence_parallel": True},
                packed=False,
            )
        )
    found.append(Case("cp", f"cp={world}, one packed row", {"context_parallel_size": world}, True))
    return found


def case_config(case: Case, base: dict[str, Any], batch: BatchedDataDict) -> dict[str, Any]:
    config = {**base, "dtensor": case.dtensor}
    if case.packed:
        # A budget of every row's tokens: first-fit packs the whole batch into one row.
        budget = int(batch["input_lengths"].sum())
        config["sequence_packing"] = {"enabled": True, "max_tokens_per_microbatch": budget}
    return config


# -- on the policy ranks -----------------------------------------------------------------------


def full_weights(worker: DTensorPolicyWorker) -> dict[str, torch.Tensor]:
    """Every weight, whole, on rank 0 (empty elsewhere). Copies: an unsharded model on the CPU
    would otherwise hand out its live parameters, which the training step then changes."""
    return {k: v.clone() for k, v in get_model_state_dict(worker.model, options=FULL).items()}


def run_step(worker: DTensorPolicyWorker, batch: BatchedDataDict) -> dict[str, Any]:
    """What the checks compare, from one rank: chunked log-probs of ``batch``, one training
    step on it, the weights before and after (whole on rank 0 only) and the token count of each
    forward pass of the step on this rank (under context parallelism, its share of the row)."""
    result: dict[str, Any] = {"initial": full_weights(worker)}
    result["logprobs"] = worker.get_logprobs(batch)["logprobs"]
    forwards: list[int] = []
    hook = worker.model.get_input_embeddings().register_forward_pre_hook(
        lambda _module, args: forwards.append(int(args[0].numel()))
    )
    try:
        result["metrics"] = worker.train(batch, NLLLoss()).metrics
    finally:
        hook.remove()
    result["forwards"] = forwards
    result["final"] = full_weights(worker)
    result["device"] = str(worker.device)
    result["backend"] = dist.get_backend() if dist.is_initialized() else "none (one process)"
    return result


def run_cases(rank: int, world: int, setup: Setup, base: dict[str, Any]) -> None:
    """Every case of this world on this rank, one worker at a time; rank 0 saves the results
    (the weights are gathered whole there)."""
    for case in cases(world):
        try:
            worker = DTensorPolicyWorker(case_config(case, base, setup.batch))
            result = run_step(worker, setup.batch)
        except Exception as e:
            raise RuntimeError(f"world {world}, {case.label}: {e}") from e
        if rank == 0:
            torch.save(result, setup.result_file(world, rank, case.name))
        del worker  # its memory, before the next case's worker is built


# -- in gpu_check's process: the reference and the checks ---------------------------------------


def reference_model(hf_config: dict[str, Any], weights: dict[str, torch.Tensor]):
    """A plain transformers model in float64 on the CPU, holding ``weights``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hf_config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64)
    model.load_state_dict({k: v.to(torch.float64) for k, v in weights.items()})
    return model


def valid_positions(batch: BatchedDataDict) -> torch.Tensor:
    """``[B, S]`` True where a token has a log-prob: after the first, before the padding."""
    pos = torch.arange(batch["input_ids"].shape[1])[None, :]
    return (pos >= 1) & (pos < batch["input_lengths"][:, None])


def reference_step(model, batch: BatchedDataDict) -> tuple[torch.Tensor, float]:
    """Next-token log-probs (``[B, S]``, 0 where there is none) and the mean NLL over all
    of them, row by row without padding; the NLL's gradient is left in ``model``'s ``.grad``."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    logprobs = torch.zeros(ids.shape, dtype=torch.float64)
    tokens = int((lengths - 1).sum())
    loss = 0.0
    model.zero_grad()
    for row, n in enumerate(lengths.tolist()):
        seq = ids[row, :n]
        logits = model(input_ids=seq[None]).logits[0].to(torch.float64)
        picked = torch.log_softmax(logits[:-1], dim=-1).gather(-1, seq[1:, None])[:, 0]
        row_loss = -picked.sum() / tokens
        row_loss.backward()
        loss += float(row_loss.detach())
        logprobs[row, 1:n] = picked.detach()
    return logprobs, loss


class Reference:
    """The float64 reference of ``setup.batch``: the model (its ``.grad`` the NLL's gradient),
    the log-probs and the loss, from the first initial weights asked about; reused while later
    ones equal them bit for bit (on qwen2-0.5b's shape each is a float64 step on the CPU).
    Each computation is printed, so a run shows whether the layouts' builds agreed."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.initial: dict[str, torch.Tensor] = {}
        self.value: tuple[Any, torch.Tensor, float] | None = None

    def of(self, initial: dict[str, torch.Tensor], where: str) -> tuple[Any, torch.Tensor, float]:
        same = self.initial.keys() == initial.keys() and all(
            torch.equal(initial[k], v) for k, v in self.initial.items()
        )
        if self.value is None or not same:
            start = time.perf_counter()
            model = reference_model(self.setup.hf_config, initial)
            self.initial, self.value = initial, (model, *reference_step(model, self.setup.batch))
            print(
                f"float64 reference computed from the initial weights of {where} "
                f"({time.perf_counter() - start:.1f} s); reused while later ones are equal",
                flush=True,
            )
        return self.value


def check_rows(world: int, results: list[dict], report: Report, reference: Reference) -> None:
    """Check 1: each rank's results of its rows, rank 0's first."""
    lead = results[0]
    logprobs = torch.cat([r["logprobs"] for r in results])
    check_step(
        f"world {world} ({lead['device']}, {lead['backend']})", lead, logprobs, report, reference
    )


def check_cases(world: int, report: Report, reference: Reference) -> None:
    """Checks 2 and 3, from rank 0's results (every rank was given the whole batch)."""
    setup = reference.setup
    for case in cases(world):
        result = torch.load(setup.result_file(world, 0, case.name))
        where = f"world {world} ({result['device']}, {result['backend']}), {case.label}"
        if case.packed:
            check_packed_share(where, world, setup.batch, result["forwards"], report)
        check_step(where, result, result["logprobs"], report, reference)


def check_packed_share(
    where: str, cp: int, batch: BatchedDataDict, forwards: list[int], report: Report
) -> None:
    """The step ran one forward pass on rank 0, over its share of the one packed row: all of
    it unsplit; split, the row padded to a multiple of ``2 * cp`` and two of its ``2 * cp``
    equal chunks (``context_parallel.split_indices``)."""
    tokens = int(batch["input_lengths"].sum())
    share = tokens if cp == 1 else 2 * -(-tokens // (2 * cp))
    how = "the whole row" if cp == 1 else f"2 of its {2 * cp} chunks, padded to {share * cp}"
    report.check(
        f"{where}: the training step's forward pass on rank 0 ran its share of the row",
        forwards == [share],
        f"token counts of rank 0's forward passes {forwards}; expected one pass of {share} "
        f"({batch.size} rows of {tokens} tokens packed into one row; rank 0's share: {how})",
    )


def check_step(
    where: str, result: dict, logprobs: torch.Tensor, report: Report, reference: Reference
) -> None:
    """Chunked log-probs (``[B, S]``, the whole batch's) and one SGD step against float64."""
    setup = reference.setup
    initial, final = result["initial"], result["final"]
    ref, ref_logprobs, ref_loss = reference.of(initial, where)

    mask = valid_positions(setup.batch)
    err = (logprobs.to(torch.float64) - ref_logprobs)[mask].abs()
    report.check(
        f"{where}: chunked log-probs (bf16, {setup.chunk_size}-token chunks) vs float64",
        float(err.max()) <= BF16_LOGPROB_MAX and float(err.mean()) <= BF16_LOGPROB_MEAN,
        f"max |error| {float(err.max()):.2e} (<= {BF16_LOGPROB_MAX}), mean "
        f"{float(err.mean()):.2e} (<= {BF16_LOGPROB_MEAN}) over {int(mask.sum())} tokens; "
        f"the reference log-probs spread {float(ref_logprobs[mask].std()):.3f} (std)",
    )

    metrics = result["metrics"]
    loss, grad_norm = metrics["loss"][0], metrics["grad_norm"][0]
    params = dict(ref.named_parameters())
    ref_norm = math.sqrt(sum(float(p.grad.square().sum()) for p in params.values()))
    diff_sq = expected_sq = 0.0
    for name, p in params.items():
        update = final[name].to(torch.float64) - initial[name].to(torch.float64)
        expected = -LR * p.grad
        diff_sq += float((update - expected).square().sum())
        expected_sq += float(expected.square().sum())
    update_rel = math.sqrt(diff_sq / expected_sq)
    loss_rel = abs(loss - ref_loss) / abs(ref_loss)
    norm_rel = abs(grad_norm - ref_norm) / ref_norm
    report.check(
        f"{where}: bf16 training step vs float64",
        loss_rel <= BF16_LOSS_REL
        and norm_rel <= BF16_GRAD_NORM_REL
        and update_rel <= BF16_UPDATE_REL,
        f"loss {loss:.5f} vs {ref_loss:.5f} (rel {loss_rel:.1e} <= {BF16_LOSS_REL}); grad norm "
        f"{grad_norm:.4e} vs {ref_norm:.4e} (rel {norm_rel:.1e} <= {BF16_GRAD_NORM_REL}); "
        f"weight update vs -lr * float64 gradient: rel L2 error {update_rel:.1e} "
        f"(<= {BF16_UPDATE_REL}) over {len(params)} tensors",
    )
