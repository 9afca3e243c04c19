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

Each gives chunked log-probs (in checks 2 and 3 every rank's, since each computes the whole
batch's) and one bf16 training step (SGD, no clipping: the update is ``-lr * gradient``),
held tensor by tensor against a plain transformers model in float64 on the CPU
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
# The bounds follow from bf16 rounding on qwen2-0.5b, the GPU run's model; they are not fitted
# to the CPU runs. bfloat16 keeps 8 significant bits, so each op's result is off by up to 2**-8
# of its size, ~2**-8 / sqrt(3) = 2.3e-3 rms, and such errors add up like a random walk. A
# token's forward pass rounds some 10 times a layer: ~250 times on 24 layers, ~0.035 of the
# logits' scale, which gpu_check's init makes about 1 nat. So log-probs are off by ~0.035 nats
# on average and by several times that on the worst of ~2000 tokens: bounds 0.1 and 0.5. A
# gradient carries the backward pass's roundings too, twice as many, ~0.05 of the update; the
# worst of ~300 tensors, one whose gradient is a sum over the tokens that partly cancels (a
# bias, a norm weight), a few times that: 0.25. That is still half the smallest error of a
# broken reduction over two ranks (a gradient halved: 0.5; doubled or zeroed: 1). The same
# count predicts micro's 2 layers on the CPU at ~0.011 nats and ~0.016 per tensor; they
# measure 0.008 to 0.011 and at most 0.027 (docs/gpu-results.md). The bugs these checks are
# for lie far above: swapping q_proj's two halves over two tensor-parallel ranks moves micro's
# log-probs by up to 2.6 nats (0.8 on average) and the worst tensor's update by 1.4.
BF16_LOGPROB_MAX, BF16_LOGPROB_MEAN = 0.5, 0.1  # |log-prob error|, nats
BF16_LOSS_REL, BF16_GRAD_NORM_REL = 0.01, 0.05
BF16_TENSOR_UPDATE_REL = 0.25  # the worst tensor's relative L2 error
# A tensor whose float64 update is below this share of the largest one's is held to the error
# allowed at that share instead of at its own size. A gradient that is zero in exact arithmetic
# (Qwen2's k_proj bias: softmax ignores a shift shared by every key) comes out of bf16 as
# rounding noise, some 2**-8 of the per-token gradients it is summed from: far below the
# error allowed at the floor, but a huge one relative to its own size, nearly zero. At
# gpu_check's init every tensor of micro and tiny is above the floor (micro's smallest update
# is 0.036 of the largest).
UPDATE_FLOOR = 0.01


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
    """Every case of this world on this rank, one worker at a time. Every rank saves its
    results: each computed the whole batch's log-probs, and any rank may get them wrong (the
    weights are whole on rank 0 only)."""
    for case in cases(world):
        try:
            worker = DTensorPolicyWorker(case_config(case, base, setup.batch))
            result = run_step(worker, setup.batch)
        except Exception as e:
            raise RuntimeError(f"world {world}, {case.label}: {e}") from e
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
    logprobs = {"": torch.cat([r["logprobs"] for r in results])}
    check_step(
        f"world {world} ({lead['device']}, {lead['backend']})", lead, logprobs, report, reference
    )


def check_cases(world: int, report: Report, reference: Reference) -> None:
    """Checks 2 and 3: every rank's log-probs (each was given the whole batch), rank 0's step."""
    setup = reference.setup
    for case in cases(world):
        results = [torch.load(setup.result_file(world, r, case.name)) for r in range(world)]
        lead = results[0]
        where = f"world {world} ({lead['device']}, {lead['backend']}), {case.label}"
        if case.packed:
            check_packed_share(where, world, setup.batch, lead["forwards"], report)
        logprobs = {f"rank {r}": result["logprobs"] for r, result in enumerate(results)}
        check_step(where, lead, logprobs, report, reference)


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
    where: str,
    result: dict,
    logprobs: dict[str, torch.Tensor],
    report: Report,
    reference: Reference,
) -> None:
    """Chunked log-probs and one SGD step against float64. ``logprobs`` holds ``[B, S]``
    log-probs of the whole batch, each checked: under ``""`` the data-parallel ranks' rows
    joined, or under ``"rank r"`` each rank's where every rank computed all of it."""
    setup = reference.setup
    initial, final = result["initial"], result["final"]
    ref, ref_logprobs, ref_loss = reference.of(initial, where)

    mask = valid_positions(setup.batch)
    errors = {k: (v.to(torch.float64) - ref_logprobs)[mask].abs() for k, v in logprobs.items()}
    report.check(
        f"{where}: chunked log-probs (bf16, {setup.chunk_size}-token chunks) vs float64",
        all(
            float(e.max()) <= BF16_LOGPROB_MAX and float(e.mean()) <= BF16_LOGPROB_MEAN
            for e in errors.values()
        ),
        "; ".join(
            f"{k + ': ' if k else ''}max |error| {float(e.max()):.2e} (<= {BF16_LOGPROB_MAX}), "
            f"mean {float(e.mean()):.2e} (<= {BF16_LOGPROB_MEAN})"
            for k, e in errors.items()
        )
        + f" over {int(mask.sum())} tokens; the reference log-probs spread "
        f"{float(ref_logprobs[mask].std()):.3f} (std)",
    )

    metrics = result["metrics"]
    loss, grad_norm = metrics["loss"][0], metrics["grad_norm"][0]
    grads = {name: p.grad for name, p in ref.named_parameters()}
    ref_norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    # Tensor by tensor: one error over all of them would be the few largest tensors' error.
    sizes = {name: LR * float(g.norm()) for name, g in grads.items()}  # of the true updates
    floor = UPDATE_FLOOR * max(sizes.values())
    update_rel = {
        name: float((final[name].double() - initial[name].double() + LR * g).norm())
        / max(sizes[name], floor)
        for name, g in grads.items()
    }
    worst = max(update_rel, key=update_rel.__getitem__)
    floored = sum(size < floor for size in sizes.values())
    loss_rel = abs(loss - ref_loss) / abs(ref_loss)
    norm_rel = abs(grad_norm - ref_norm) / ref_norm
    uniform = math.log(setup.hf_config["vocab_size"])
    report.check(
        f"{where}: bf16 training step vs float64",
        loss_rel <= BF16_LOSS_REL
        and norm_rel <= BF16_GRAD_NORM_REL
        and update_rel[worst] <= BF16_TENSOR_UPDATE_REL,
        f"loss {loss:.5f} vs {ref_loss:.5f} (rel {loss_rel:.1e} <= {BF16_LOSS_REL}; a uniform "
        f"model's: {uniform:.3f}); grad norm {grad_norm:.4e} vs {ref_norm:.4e} (rel "
        f"{norm_rel:.1e} <= {BF16_GRAD_NORM_REL}); weight update vs -lr * float64 gradient, "
        f"tensor by tensor: worst rel L2 error {update_rel[worst]:.1e} ({worst}) "
        f"(<= {BF16_TENSOR_UPDATE_REL}) over {len(grads)} tensors, {floored} of them below "
        f"{UPDATE_FLOOR} of the largest update and held to that",
    )
