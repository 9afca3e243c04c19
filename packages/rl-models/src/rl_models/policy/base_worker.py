"""What every policy worker shares, whatever model it holds: the training loop and its batching.

A backend (``DTensorPolicyWorker``: Hugging Face model under FSDP2; ``MegatronPolicyWorker``:
Megatron-core ``GPTModel``) subclasses ``PolicyWorker`` and supplies the model, the optimiser
over it (``_make_optimizer``), one step's forward/backward (``_run_step``), the gradient
synchronisation, clipping and update (``_clip_and_step``), the log-prob passes and checkpoints.
The loop itself (global-batch token counts before any loss, one optimiser step per global
batch, gradients freed after each step), micro-batch planning, device choice and offloading
live here, so both backends behave alike.

Every forward pass of a sharded model is a collective, so all ranks must run the same number
of forward passes: each loop first agrees on the largest micro-batch count (``_same_count``)
and ranks with fewer run dummy passes.
"""

from __future__ import annotations

import abc
import contextlib
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.interfaces import LossFunction, TrainResult, combine_metric
from rl_models.modeling.random_streams import DROPOUT_STREAM, row_seed, seeded_generators
from rl_models.policy import offload
from rl_models.policy.config import PolicyConfig, build_scheduler


def local_device() -> torch.device:
    """The accelerator this process should use (the CPU when there is none).

    A Ray actor started with ``num_gpus=1`` sees exactly one GPU, which Ray exposes through
    ``CUDA_VISIBLE_DEVICES``: it is ``cuda:0`` whatever the worker's ``LOCAL_RANK``. A launcher
    such as ``torchrun`` instead shows every GPU of the node to every process, which then takes
    the one at its ``LOCAL_RANK``.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if visible == 1:
        return torch.device("cuda", 0)
    if local_rank < visible:
        return torch.device("cuda", local_rank)
    raise RuntimeError(
        f"LOCAL_RANK={local_rank} but this process sees only {visible} GPUs "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); give each worker "
        "one GPU, or all of the node's GPUs"
    )


def init_distributed(device: torch.device, always: bool = False) -> None:
    """Join the ranks the worker group started (``RANK``/``WORLD_SIZE``/``MASTER_*``).

    ``always``: make a one-rank group when there are no peers (Megatron needs a group even
    alone); otherwise a lone worker stays without ``torch.distributed``.
    """
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or (always and "MASTER_ADDR" in os.environ):
        dist.init_process_group(backend, init_method="env://")
    elif always:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


#: Optimiser options that choose how an update is computed, not what it is.
KERNEL_OPTIONS = ("fused", "foreach")

#: How a batch is cut into micro-batches (see ``batching_kind``).
Batching = Literal["packed", "dynamic", "fixed"]


def batching_kind(config: PolicyConfig, on_gpu: bool) -> Batching:
    """The micro-batching the config asks for on this hardware.

    ``dynamic_batching.enabled: auto`` means dynamic batching on the CPU (measured faster
    there than both packing and fixed micro-batches, ``bench/train_step.py``) and fixed
    micro-batches on GPUs; packing, when enabled, wins over ``auto``.
    """
    if config.sequence_packing.enabled:
        return "packed"
    enabled = config.dynamic_batching.enabled
    if enabled == "auto":
        enabled = not on_gpu
    return "dynamic" if enabled else "fixed"


def describe_batching(config: PolicyConfig, on_gpu: bool) -> str:
    """One line saying which micro-batching runs and why (for the logs)."""
    kind = batching_kind(config, on_gpu)
    where = "GPU" if on_gpu else "CPU"
    if config.dynamic_batching.enabled != "auto" or kind == "packed":
        return f"policy micro-batches: {kind} (as configured)"
    if kind == "fixed":
        return f"policy micro-batches: fixed (dynamic_batching.enabled=auto on {where})"
    budget = config.dynamic_batching.train_mb_tokens
    budget_text = (
        f"{budget} tokens (dynamic_batching.train_mb_tokens)"
        if budget is not None
        else f"train_micro_batch_size={config.train_micro_batch_size} x the batch's padded width"
    )
    return (
        f"policy micro-batches: dynamic (dynamic_batching.enabled=auto on {where}), up to "
        f"{budget_text} each; set policy.dynamic_batching.enabled=false for fixed micro-batches "
        "of train_micro_batch_size rows"
    )


def microbatch_args(
    config: PolicyConfig, training: bool, on_gpu: bool, width: int, rows: int | None = None
) -> dict[str, Any]:
    """``shard_by_batch_size`` arguments for the micro-batches the config asks for.

    Empty for fixed-size micro-batches; otherwise a sequence-packing or dynamic-batching plan
    (the token budget of dynamic batching differs between training and log-prob inference).
    ``width``: the batch's padded length; ``rows``: the micro-batch size in rows (default: the
    config's), which with ``width`` gives the token budget when none is configured.
    """
    kind = batching_kind(config, on_gpu)
    if kind == "packed":
        packing = config.sequence_packing
        budget = packing.max_tokens_per_microbatch
        if not training:
            budget = packing.logprob_max_tokens_per_microbatch or budget
        return {
            "sequence_packing_args": {
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "max_tokens_per_microbatch": budget,
                "algorithm": packing.algorithm,
            }
        }
    if kind == "dynamic":
        dyn = config.dynamic_batching
        if training:
            budget = dyn.train_mb_tokens
            rows = rows or config.train_micro_batch_size
        else:
            budget = dyn.logprob_mb_tokens or dyn.train_mb_tokens
            rows = rows or config.lp_micro_batch_size
        return {
            "dynamic_batching_args": {
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "max_tokens_per_microbatch": budget or rows * max(width, 1),
                "sequence_length_round": dyn.sequence_length_round,
            }
        }
    return {}


def trim_to_longest_row(mb: BatchedDataDict) -> BatchedDataDict:
    """``mb`` with its per-token tensors cut to its own longest row (``input_lengths``).

    A fixed-size micro-batch of short rows would otherwise carry the whole batch's padding.
    Only tensors as wide as ``input_ids`` are cut; per-row values (``[B]``, ``[B, labels]``)
    are kept.
    """
    width = mb["input_ids"].shape[1]
    longest = max(int(mb["input_lengths"].max()), 1) if mb.size else width
    if longest >= width:
        return mb
    for key, value in list(mb.items()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width:
            mb[key] = value[:, :longest]
    return mb


class PolicyWorker(abc.ABC):
    """One rank of a policy: the training loop, micro-batching and offloading of any backend.

    Subclasses set ``config``, ``device``, ``dp_size``, ``rank``, ``model``, ``optimizer`` and
    ``scheduler`` in their ``__init__``.
    """

    config: PolicyConfig
    device: torch.device
    dp_size: int
    #: The data-parallel ranks' group (None: all ranks, when each holds a whole model copy).
    dp_group: dist.ProcessGroup | None = None
    _loss_metrics: list[dict[str, float]] | None = None
    rank: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def batching(self) -> Batching:
        """The micro-batching this worker uses (``dynamic_batching.enabled: auto`` resolved)."""
        return batching_kind(self.config, self.on_gpu)

    @contextlib.contextmanager
    def _seeded_dropout(self) -> Iterator[None]:
        """Dropout's random numbers for one optimiser step, from the policy seed, this rank and
        the optimiser steps taken so far.

        torch seeds its global generator at random in every process, so dropout would
        otherwise differ between two runs of one config, and between a run and its resume
        (the scheduler's step count is in the checkpoint). The caller's generators are left as
        they were.

        Every rank draws its own stream. Under tensor or context parallelism a rank's
        attention dropout covers its own heads or its own tokens, which must not share masks
        with the other ranks'; the tensor-parallel plans here put no dropout on activations
        that the ranks hold whole (the Megatron backend runs without dropout).
        """
        seed = row_seed(self.config.seed, DROPOUT_STREAM, self.rank, self.scheduler.last_epoch)
        with seeded_generators(seed, [self.device] if self.on_gpu else []):
            yield

    def _make_optimizer(self) -> None:
        """The optimiser over the trainable parameters, and its scheduler, from the config."""
        opt = self.config.optimizer
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = getattr(torch.optim, opt.name)(trainable, **opt.kwargs)
        self.scheduler = build_scheduler(self.optimizer, self.config.scheduler)

    def _restore_configured_kernels(self) -> None:
        """After loading optimiser state: the update kernels the config asks for, not the
        checkpoint's. torch keeps a loaded state's parameter-group options, so a run resumed
        from a checkpoint of a for-loop AdamW would stay on the for-loop even with ``fused:
        true`` in its config (same numbers up to rounding, 4x the time here)."""
        kwargs = self.config.optimizer.kwargs
        fused = False
        for group in self.optimizer.param_groups:
            for key in KERNEL_OPTIONS:
                if key in group:
                    group[key] = kwargs.get(key)  # None: torch's default
            fused |= bool(group.get("fused"))
        if not fused:
            return  # the for-loop reads a step count wherever the checkpoint left it
        # Fused kernels read each step count on the parameter's device; a for-loop
        # checkpoint keeps them on the CPU.
        for param, state in self.optimizer.state.items():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.dim() == 0:
                state["step"] = step.to(param.device)

    # -- collectives -------------------------------------------------------------------------

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce over the data-parallel ranks (``dp_group``); the result on the CPU."""
        if self.dp_size > 1:
            t = t.to(self.device)
            dist.all_reduce(t, op=op, group=self.dp_group)
        return t.cpu()

    def _same_count(self, items: list[Any]) -> list[Any]:
        """``items`` padded with ``None`` to the largest length any rank has."""
        n = int(self._all_reduce(torch.tensor([len(items)]), dist.ReduceOp.MAX))
        return items + [None] * (n - len(items))

    # -- micro-batches -----------------------------------------------------------------------

    def _steps(
        self, data: BatchedDataDict, rows_per_step: int, mbs: int, training: bool
    ) -> tuple[list[list[BatchedDataDict]], list[int] | None]:
        """Micro-batches of each step, and the order to restore per-row outputs to.

        Uses the packing or dynamic-batching plan of ``data`` when the controller made one (so
        every rank has the same micro-batch counts), makes one here when the config asks for
        it and there is none, and otherwise cuts ``mbs`` rows at a time, each micro-batch as
        wide as its own longest row.
        """
        width = data["input_ids"].shape[1]
        args = microbatch_args(self.config, training, self.on_gpu, width, rows=mbs)
        if not args:
            steps = [data.slice(s, s + rows_per_step) for s in range(0, data.size, rows_per_step)]
            return [
                [trim_to_longest_row(mb) for mb in step.make_microbatch_iterator(mbs)]
                for step in steps
            ], None
        kind = "packed" if "sequence_packing_args" in args else "dynamic"
        restore = None
        if data.micro_batch_kind != kind:
            (data,), restore = data.shard_by_batch_size(1, batch_size=rows_per_step, **args)
        flat: Iterator[BatchedDataDict] = (
            data.make_microbatch_iterator_for_packable_sequences()
            if kind == "packed"
            else data.make_microbatch_iterator_with_dynamic_shapes()
        )
        counts = [len(step) for step in data.micro_batch_indices or []]
        return [[next(flat) for _ in range(n)] for n in counts], restore

    # -- training ----------------------------------------------------------------------------

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """One optimiser step per global batch of ``gbs`` rows (this rank holds 1/dp of each).

        ``_loss_output`` (what the loss is given), ``_run_step`` (forward and backward of one
        step's micro-batches) and ``_clip_and_step`` are where the backends differ.
        """
        output = self._loss_output(loss_fn)
        gbs = gbs or self.config.train_global_batch_size
        mbs = mbs or self.config.train_micro_batch_size
        if gbs % self.dp_size:
            raise ValueError(f"global batch size {gbs} is not divisible by {self.dp_size} ranks")
        steps, _ = self._steps(data, gbs // self.dp_size, mbs, training=True)
        self.model.train(not eval_mode)
        metrics: dict[str, list[float]] = {}
        optimizer_steps = 0
        for step in self._same_count(steps):
            step = [mb for mb in step or [] if mb.size > 0]
            # Count the valid samples and tokens of the whole global batch before any loss is
            # computed, so every micro-batch loss is normalised by the same global count.
            batches = [TrainBatch.from_transport(mb) for mb in step]
            local = torch.tensor(
                [
                    sum(float(batch.sample_valid_mask().sum()) for batch in batches),
                    sum(float(batch.loss_token_mask().sum()) for batch in batches),
                ],
                dtype=torch.float64,
            )
            global_seqs, global_toks = self._all_reduce(local)
            self.optimizer.zero_grad(set_to_none=True)
            self._loss_metrics = None  # a backend's _run_step may collect the losses' metrics
            with torch.set_grad_enabled(not eval_mode), self._seeded_dropout():
                loss_sum = self._run_step(
                    step, loss_fn, output, global_seqs, global_toks, eval_mode
                )
            step_metrics = {
                **self._reduce_loss_metrics(),
                "loss": float(self._all_reduce(loss_sum)),
                "global_valid_seqs": float(global_seqs),
                "global_valid_toks": float(global_toks),
                "lr": self.optimizer.param_groups[0]["lr"],
            }
            if not eval_mode:
                step_metrics["grad_norm"] = self._clip_and_step()
                optimizer_steps += 1
                # Gradients are dead once applied: free them now rather than keep a model's
                # worth of memory through generation until the next step's zero_grad.
                self.optimizer.zero_grad(set_to_none=True)
            for k, v in step_metrics.items():
                metrics.setdefault(k, []).append(v)
        return TrainResult(optimizer_steps, metrics)

    def _reduce_loss_metrics(self) -> dict[str, float]:
        """The metrics the loss returned for this step's micro-batches, over all ranks.

        Losses normalise their metrics like the loss (by the global counts), so they add up;
        ``Min`` / ``Max`` values are extremes and combine by min / max. Empty when the
        backend's ``_run_step`` does not collect them.
        """
        if self._loss_metrics is None:
            return {}
        per_rank = [self._loss_metrics]
        if self.dp_size > 1:
            per_rank = [None] * self.dp_size
            dist.all_gather_object(per_rank, self._loss_metrics, group=self.dp_group)
        gathered: dict[str, list[float]] = {}
        for metrics in (m for rank in per_rank for m in rank):
            for key, value in metrics.items():
                gathered.setdefault(key, []).append(value)
        return {key: combine_metric(values, _sum_in_order, key) for key, values in gathered.items()}

    @abc.abstractmethod
    def _loss_output(self, loss_fn: LossFunction) -> Any:
        """What ``_run_step`` computes for ``loss_fn``, from its declared ``input_type`` (this
        backend's object for it); refuses an input this backend or model cannot give."""

    @abc.abstractmethod
    def _run_step(
        self,
        step: list[BatchedDataDict],
        loss_fn: LossFunction,
        output: Any,
        global_seqs: torch.Tensor,
        global_toks: torch.Tensor,
        eval_mode: bool,
    ) -> torch.Tensor:
        """Forward (and backward) of one step's micro-batches, giving ``loss_fn`` ``output``
        (``_loss_output``'s); the sum of their losses."""

    @abc.abstractmethod
    def _clip_and_step(self) -> float:
        """Synchronise and clip the gradients, step the optimiser and the schedule; the norm."""

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare_for_training(self) -> None:
        """Weights and optimiser state back on the device (if offloaded); training mode."""
        self.reload()
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        """Weights on the device; the optimiser state away if ``offload.optimizer_state``."""
        offload.move_module(self.model, self.device, copy=False)
        offload.synchronize()
        if self.config.offload.optimizer_state:
            self.offload_optimizer_state()
        self.model.eval()

    def offload_weights(self) -> None:
        """Parameters and buffers to ``offload.device`` (e.g. once refit into vLLM)."""
        offload.move_module(self.model, torch.device(self.config.offload.device), copy=True)
        offload.synchronize()
        offload.release_cached_memory(self.device)

    def offload_optimizer_state(self) -> None:
        """Optimiser state to ``offload.device`` (e.g. before generation or refit)."""
        target = torch.device(self.config.offload.device)
        offload.move_optimizer_state(self.optimizer, target, copy=True)
        offload.synchronize()
        offload.release_cached_memory(self.device)

    def reload(self) -> None:
        """Undo ``offload_weights`` and ``offload_optimizer_state`` (no-op when not offloaded)."""
        offload.move_module(self.model, self.device, copy=False)
        offload.move_optimizer_state(self.optimizer, self.device, copy=False)
        offload.synchronize()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _sum_in_order(values: list[float]) -> float:
    """``values[0] + values[1] + ...``, in that order, from the first (not from 0)."""
    total = values[0]
    for v in values[1:]:
        total += v
    return total
