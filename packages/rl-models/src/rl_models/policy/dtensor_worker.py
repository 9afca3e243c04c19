"""A policy worker for Hugging Face causal LMs, sharded with FSDP2 (DTensor) across its ranks.

One process per data-parallel rank; ranks meet through ``torch.distributed`` (gloo on CPU,
NCCL on GPU) from the ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables the worker group sets.
Without ``WORLD_SIZE`` (or with 1) the worker runs alone, unsharded, in the calling process.

Every forward pass of an FSDP2 model all-gathers parameters, so all ranks must run the same
number of forward passes: each loop first agrees on the largest micro-batch count and ranks
with fewer run dummy passes.

With ``lora.enabled`` the model is a ``peft`` model (see ``lora.py``): only the adapters train,
the reference policy is the same model with its adapters switched off (no copy), and a
checkpoint holds the merged model plus the adapters.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.interfaces import LossFunction, loss_input_type
from rl_models.losses import loss_token_mask, sample_valid_mask
from rl_models.policy import checkpoint, lora, offload
from rl_models.policy.checkpoint import OPTIMIZER_FILE, SCHEDULER_FILE  # noqa: F401 (re-export)
from rl_models.policy.config import PolicyConfig
from rl_models.policy.forward import build_model, forward_logits, forward_logprobs, forward_scores
from rl_models.policy.weight_export import DTensorWeightExporter, WeightExportMethods


def microbatch_args(config: PolicyConfig, training: bool) -> dict[str, Any]:
    """``shard_by_batch_size`` arguments for the micro-batches the config asks for.

    Empty for fixed-size micro-batches; otherwise a sequence-packing or dynamic-batching plan
    (the token budget of dynamic batching differs between training and log-prob inference).
    """
    if config.sequence_packing.enabled:
        packing = config.sequence_packing
        return {
            "sequence_packing_args": {
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "max_tokens_per_microbatch": packing.max_tokens_per_microbatch,
                "algorithm": packing.algorithm,
            }
        }
    if config.dynamic_batching.enabled:
        dyn = config.dynamic_batching
        budget = dyn.train_mb_tokens if training else dyn.logprob_mb_tokens or dyn.train_mb_tokens
        return {
            "dynamic_batching_args": {
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "max_tokens_per_microbatch": budget,
                "sequence_length_round": dyn.sequence_length_round,
            }
        }
    return {}


class DTensorPolicyWorker(WeightExportMethods):
    """Holds one rank of the policy (and optionally a frozen reference copy)."""

    def __init__(self, config: PolicyConfig | dict[str, Any]) -> None:
        self.config = PolicyConfig.model_validate(config)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                self.device = torch.device("cuda", torch.cuda.current_device())
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method="env://")
        self.dp_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0

        model = build_model(self.config)
        self.lora = self.config.lora.enabled
        self.reference: torch.nn.Module | None = None
        if self.config.reference_policy.enabled and not self.lora:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
            ref_device = "cpu" if self.config.reference_policy.offload_to_cpu else self.device
            self.reference.to(ref_device)
        if self.config.activation_checkpointing:
            # Recompute each layer's activations in backward: memory for compute.
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()
            if self.lora:  # frozen embeddings: checkpointed layers still need grad inputs
                model.enable_input_require_grads()
        if self.lora:
            model = lora.wrap_with_lora(model, self.config.lora)
        self.model = self._shard(model.to(self.device))
        self._make_optimizer()

    def _make_optimizer(self) -> None:
        """The optimiser over the trainable parameters, and its scheduler, from the config."""
        opt = self.config.optimizer
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = getattr(torch.optim, opt.name)(trainable, **opt.kwargs)
        sched = self.config.scheduler
        self.scheduler = (
            getattr(torch.optim.lr_scheduler, sched.name)(self.optimizer, **sched.kwargs)
            if sched is not None
            else torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        )

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2: each decoder layer, then the rest, sharded over all ranks (works on gloo).

        A peft model is sharded the same way (its decoder layers are those of the base model);
        FSDP2 takes the mix of frozen base and trainable adapter parameters in one group.
        """
        if self.dp_size == 1:
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.dp_size,), mesh_dim_names=("dp",))
        precision = MixedPrecisionPolicy()
        if self.config.mixed_precision is not None:
            # Parameters are all-gathered in the compute dtype (half the traffic); gradients
            # are reduced and kept in the weights' dtype.
            compute = getattr(torch, self.config.mixed_precision)
            precision = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        base = model.get_base_model() if self.lora else model
        for layer in getattr(getattr(base, "model", base), "layers", []):
            fully_shard(layer, mesh=mesh, mp_policy=precision)
        return fully_shard(model, mesh=mesh, mp_policy=precision)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 compute for an unsharded model (FSDP2 casts sharded ones itself)."""
        if self.config.mixed_precision is None or self.dp_size > 1:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.config.mixed_precision))

    # -- collectives -------------------------------------------------------------------------

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce over the data-parallel ranks (here: all ranks); the result on the CPU."""
        if self.dp_size > 1:
            t = t.to(self.device)
            dist.all_reduce(t, op=op)
        return t.cpu()

    def _same_count(self, items: list[Any]) -> list[Any]:
        """``items`` padded with ``None`` to the largest length any rank has."""
        n = int(self._all_reduce(torch.tensor([len(items)]), dist.ReduceOp.MAX))
        return items + [None] * (n - len(items))

    def _dummy_logits(self, model: torch.nn.Module) -> torch.Tensor:
        return model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device)).logits

    # -- micro-batches -----------------------------------------------------------------------

    def _steps(
        self, data: BatchedDataDict, rows_per_step: int, mbs: int, training: bool
    ) -> tuple[list[list[BatchedDataDict]], list[int] | None]:
        """Micro-batches of each step, and the order to restore per-row outputs to.

        Uses the packing or dynamic-batching plan of ``data`` when the controller made one (so
        every rank has the same micro-batch counts), makes one here when the config asks for
        it and there is none, and otherwise cuts ``mbs`` rows at a time.
        """
        args = microbatch_args(self.config, training)
        if not args:
            steps = [data.slice(s, s + rows_per_step) for s in range(0, data.size, rows_per_step)]
            return [list(step.make_microbatch_iterator(mbs)) for step in steps], None
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

    def _forward(self, model: torch.nn.Module, mb: BatchedDataDict, output: str) -> torch.Tensor:
        """``output`` ("logprobs", "logits" or "scores") of one micro-batch on this device."""
        forward = {"logprobs": forward_logprobs, "logits": forward_logits, "scores": forward_scores}
        if (output == "scores") != (self.config.model.kind == "sequence_classification"):
            raise ValueError(f"a {self.config.model.kind} model has no {output}")
        packed = self.config.sequence_packing.enabled
        extra = {"temperature": self.config.logprob_temperature} if output == "logprobs" else {}
        with self._autocast():
            out = forward[output](model, mb, packed, self.config.model.attn_implementation, **extra)
        # Losses and metrics in at least the weights' precision, whatever the compute dtype.
        return out.to(torch.promote_types(out.dtype, self.config.model.torch_dtype))

    # -- inference ---------------------------------------------------------------------------

    @torch.no_grad()
    def _per_row(self, model: torch.nn.Module, data: BatchedDataDict, output: str) -> torch.Tensor:
        """Per-row ``output`` of ``data``, in its row order, padded back to its width."""
        model.eval()
        width = data["input_ids"].shape[1]
        (mbs,), restore = self._steps(data, data.size, self.config.lp_micro_batch_size, False)
        out = []
        for mb in self._same_count(mbs):
            if mb is None or mb.size == 0:
                self._dummy_logits(model)  # keep FSDP's all-gathers in step with the peers
                continue
            values = self._forward(model, mb.to(self.device), output).cpu()
            if output != "scores":  # per-token values: pad to the batch's width
                values = F.pad(values, (0, width - values.shape[1]))
            out.append(values)
        result = torch.cat(out)
        return result[torch.tensor(restore)] if restore is not None else result

    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        return BatchedDataDict({"logprobs": self._per_row(self.model, data, "logprobs")})

    def get_scores(self, data: BatchedDataDict) -> BatchedDataDict:
        """``{"scores": [B, num_labels]}`` of a sequence classifier (reward model)."""
        return BatchedDataDict({"scores": self._per_row(self.model, data, "scores")})

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        if self.lora and self.config.reference_policy.enabled:
            # The frozen base weights are the initial policy: switch the adapters off.
            with self.model.disable_adapter():
                lp = self._per_row(self.model, data, "logprobs")
            return BatchedDataDict({"reference_logprobs": lp})
        if self.reference is None:
            raise RuntimeError("this policy has no reference model (reference_policy.enabled)")
        self.reference.to(self.device)
        try:
            lp = self._per_row(self.reference, data, "logprobs")
            return BatchedDataDict({"reference_logprobs": lp})
        finally:
            if self.config.reference_policy.offload_to_cpu:
                self.reference.to("cpu")

    # -- training ----------------------------------------------------------------------------

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, list[float]]:
        """One optimiser step per global batch of ``gbs`` rows (this rank holds 1/dp of each).

        The loop is shared by every backend; ``_run_step`` (forward and backward of one step's
        micro-batches) and ``_clip_and_step`` are where they differ.
        """
        gbs = gbs or self.config.train_global_batch_size
        mbs = mbs or self.config.train_micro_batch_size
        if gbs % self.dp_size:
            raise ValueError(f"global batch size {gbs} is not divisible by {self.dp_size} ranks")
        steps, _ = self._steps(data, gbs // self.dp_size, mbs, training=True)
        self.model.train(not eval_mode)
        metrics: dict[str, list[float]] = {}
        for step in self._same_count(steps):
            step = [mb for mb in step or [] if mb.size > 0]
            # Count the valid samples and tokens of the whole global batch before any loss is
            # computed, so every micro-batch loss is normalised by the same global count.
            local = torch.tensor(
                [
                    sum(float(sample_valid_mask(mb).sum()) for mb in step),
                    sum(float(loss_token_mask(mb).sum()) for mb in step),
                ],
                dtype=torch.float64,
            )
            global_seqs, global_toks = self._all_reduce(local)
            self.optimizer.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(not eval_mode):
                loss_sum = self._run_step(step, loss_fn, global_seqs, global_toks, eval_mode)
            step_metrics = {
                "loss": float(self._all_reduce(loss_sum)),
                "global_valid_seqs": float(global_seqs),
                "global_valid_toks": float(global_toks),
                "lr": self.optimizer.param_groups[0]["lr"],
            }
            if not eval_mode:
                step_metrics["grad_norm"] = self._clip_and_step()
            for k, v in step_metrics.items():
                metrics.setdefault(k, []).append(v)
        return metrics

    def _run_step(
        self,
        step: list[BatchedDataDict],
        loss_fn: LossFunction,
        global_seqs: torch.Tensor,
        global_toks: torch.Tensor,
        eval_mode: bool,
    ) -> torch.Tensor:
        """Forward (and backward) of one step's micro-batches; the sum of their losses."""
        output = "scores" if self.config.model.kind == "sequence_classification" else None
        output = output or loss_input_type(loss_fn)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for mb in self._same_count(step):
            if mb is None:
                loss = self._dummy_logits(self.model).sum() * 0.0
            else:
                mb = mb.to(self.device)
                loss, _ = loss_fn(
                    self._forward(self.model, mb, output), mb, global_seqs, global_toks
                )
            if not eval_mode:
                # FSDP averages gradients over ranks; the losses are already global means, so
                # the sum over ranks is wanted: undo the average.
                (loss * self.dp_size).backward()
            loss_sum += loss.detach().double().cpu()
        return loss_sum

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm or math.inf)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        return float(norm)

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

    def offload_optimizer_state(self) -> None:
        """Optimiser state to ``offload.device`` (e.g. before generation or refit)."""
        target = torch.device(self.config.offload.device)
        offload.move_optimizer_state(self.optimizer, target, copy=True)
        offload.synchronize()

    def reload(self) -> None:
        """Undo ``offload_weights`` and ``offload_optimizer_state`` (no-op when not offloaded)."""
        offload.move_module(self.model, self.device, copy=False)
        offload.move_optimizer_state(self.optimizer, self.device, copy=False)
        offload.synchronize()

    # -- weight export (refit: rl_models.generation.refit) -------------------------------------

    def _weight_exporter(self) -> DTensorWeightExporter:
        return DTensorWeightExporter(self.model, self.lora, self.rank)

    def save_checkpoint(self, path: str) -> None:
        """HF safetensors weights (``from_pretrained``-loadable) + optimiser + scheduler.

        ``checkpoint.sharded``: every rank writes its own shards (see ``checkpoint.py``).
        Otherwise full state dicts are gathered to rank 0, which writes everything; with LoRA
        the weights are the merged model and the adapters go to ``path/adapter`` (``lora.py``).
        """
        if self.config.checkpoint.sharded:
            checkpoint.save_sharded(self.model, self.optimizer, path, self.rank)
        else:
            weights = checkpoint.save_full_training_state(
                self.model, self.optimizer, path, self.rank
            )
            if self.rank == 0 and self.lora:
                lora.save_lora_checkpoint(self.model, weights, path)
            elif self.rank == 0:
                self.model.save_pretrained(path, state_dict=weights)
        if self.rank == 0:
            checkpoint.save_scheduler(self.scheduler, path)
        if self.dp_size > 1:
            dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote, in either layout (every rank reads ``path``)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        if checkpoint.is_sharded(path):
            checkpoint.load_sharded(self.model, self.optimizer, path)
        else:
            opts = StateDictOptions(full_state_dict=True, strict=not self.lora)
            if self.lora:
                # The base weights are those of config.model, frozen: only adapters are read.
                weights = lora.load_adapter_state_dict(path)
            else:
                # from_pretrained resolves tied and renamed weights the way HF saved them.
                saved = self._hf_class().from_pretrained(path, dtype=self.config.model.torch_dtype)
                weights = saved.state_dict()
            set_model_state_dict(self.model, weights, options=opts)
            checkpoint.load_full_optimizer(self.model, self.optimizer, path)
        checkpoint.load_scheduler(self.scheduler, path)

    def _hf_class(self) -> type[torch.nn.Module]:
        """The Hugging Face model class (FSDP2 subclasses it on the fly; peft wraps it)."""
        model = self.model.get_base_model() if self.lora else self.model
        for cls in type(model).__mro__:
            if cls.__module__.startswith("transformers."):
                return cls
        return type(model)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
