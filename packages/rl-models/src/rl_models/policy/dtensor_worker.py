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

import copy
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from rl_distributed.batched_data_dict import BatchedDataDict, SequencePackingArgs
from rl_distributed.packing import pack_sequences, unpack_sequences
from rl_models.interfaces import LossFunction
from rl_models.losses import loss_token_mask, sample_valid_mask
from rl_models.policy import lora, offload
from rl_models.policy.config import PolicyConfig

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"


def packing_args(config: PolicyConfig) -> SequencePackingArgs:
    return {
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "max_tokens_per_microbatch": config.sequence_packing.max_tokens_per_microbatch,
        "algorithm": config.sequence_packing.algorithm,
    }


def build_model(config: PolicyConfig) -> PreTrainedModel:
    """The model the config names; sdpa attention, which takes our block-diagonal masks."""
    cfg = config.model
    torch.manual_seed(config.seed)  # fresh weights are identical on every rank
    if cfg.path is not None:
        return AutoModelForCausalLM.from_pretrained(
            cfg.path, dtype=cfg.torch_dtype, attn_implementation="sdpa"
        )
    hf = dict(cfg.hf_config or {})
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    hf_config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(hf_config, dtype=cfg.torch_dtype)


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) under ``logits``; half precisions are upcast for a stable softmax."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def forward_logprobs(model: torch.nn.Module, mb: BatchedDataDict, packed: bool) -> torch.Tensor:
    """``[B, S]`` next-token log-probs of one micro-batch (0 at position 0 and on padding)."""
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    batch, width = ids.shape
    pos = torch.arange(width, device=ids.device)
    real = pos[None, :] < lengths[:, None].to(ids.device)
    if not packed:
        logits = model(input_ids=ids, attention_mask=real.long()).logits
        lp = _token_logprobs(logits[:, :-1], ids[:, 1:])
        return F.pad(lp, (1, 0)) * real
    p = pack_sequences(ids, lengths)
    # Position ids alone do not keep packed sequences apart with sdpa/eager attention, so the
    # mask is block-diagonal causal: a token sees earlier tokens of its own sequence only.
    seq = torch.repeat_interleave(
        torch.arange(batch, device=ids.device), p.cu_seqlens.diff().long().to(ids.device)
    )
    total = seq.numel()
    causal = torch.ones(total, total, dtype=torch.bool, device=ids.device).tril()
    mask = (causal & (seq[:, None] == seq[None, :]))[None, None]
    logits = model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=mask).logits
    lp = F.pad(_token_logprobs(logits[0, :-1], p.input_ids[0, 1:]), (1, 0))
    lp = lp * (p.position_ids[0] > 0)  # a sequence's first token has no log-prob
    return unpack_sequences(lp[None], p.cu_seqlens, lengths, width)


class DTensorPolicyWorker:
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
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.dp_size,), mesh_dim_names=("dp",))
        base = model.get_base_model() if self.lora else model
        for layer in getattr(getattr(base, "model", base), "layers", []):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    # -- collectives -------------------------------------------------------------------------

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
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
        self, data: BatchedDataDict, rows_per_step: int, mbs: int
    ) -> tuple[list[list[BatchedDataDict]], list[int] | None]:
        """Micro-batches of each step, and the order to restore per-row outputs to.

        Uses the packing plan of ``data`` when the controller made one (so every rank has the
        same micro-batch counts), plans packing here when packing is on and there is no plan,
        and otherwise cuts ``mbs`` rows at a time.
        """
        packed = self.config.sequence_packing.enabled
        restore = None
        if packed and data.micro_batch_kind != "packed":
            (data,), restore = data.shard_by_batch_size(
                1, batch_size=rows_per_step, sequence_packing_args=packing_args(self.config)
            )
        if packed:
            flat: Iterator[BatchedDataDict] = data.make_microbatch_iterator_for_packable_sequences()
            counts = [len(step) for step in data.micro_batch_indices or []]
            return [[next(flat) for _ in range(n)] for n in counts], restore
        steps = [data.slice(s, s + rows_per_step) for s in range(0, data.size, rows_per_step)]
        return [list(step.make_microbatch_iterator(mbs)) for step in steps], None

    # -- inference ---------------------------------------------------------------------------

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, data: BatchedDataDict) -> torch.Tensor:
        model.eval()
        width = data["input_ids"].shape[1]
        (mbs,), restore = self._steps(data, data.size, self.config.lp_micro_batch_size)
        out = []
        for mb in self._same_count(mbs):
            if mb is None or mb.size == 0:
                self._dummy_logits(model)  # keep FSDP's all-gathers in step with the peers
                continue
            lp = forward_logprobs(model, mb.to(self.device), self.config.sequence_packing.enabled)
            out.append(F.pad(lp, (0, width - lp.shape[1])).cpu())
        result = torch.cat(out) if out else torch.zeros(0, width)
        return result[torch.tensor(restore)] if restore is not None else result

    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        return BatchedDataDict({"logprobs": self._logprobs(self.model, data)})

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        if self.lora and self.config.reference_policy.enabled:
            # The frozen base weights are the initial policy: switch the adapters off.
            with self.model.disable_adapter():
                return BatchedDataDict({"reference_logprobs": self._logprobs(self.model, data)})
        if self.reference is None:
            raise RuntimeError("this policy has no reference model (reference_policy.enabled)")
        self.reference.to(self.device)
        try:
            return BatchedDataDict({"reference_logprobs": self._logprobs(self.reference, data)})
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
        """One optimiser step per global batch of ``gbs`` rows (this rank holds 1/dp of each)."""
        gbs = gbs or self.config.train_global_batch_size
        mbs = mbs or self.config.train_micro_batch_size
        if gbs % self.dp_size:
            raise ValueError(f"global batch size {gbs} is not divisible by {self.dp_size} ranks")
        steps, _ = self._steps(data, gbs // self.dp_size, mbs)
        params = [p for p in self.model.parameters() if p.requires_grad]
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
            loss_sum = torch.zeros((), dtype=torch.float64)
            with torch.set_grad_enabled(not eval_mode):
                for mb in self._same_count(step):
                    if mb is None:
                        loss = self._dummy_logits(self.model).sum() * 0.0
                    else:
                        mb = mb.to(self.device)
                        lp = forward_logprobs(self.model, mb, self.config.sequence_packing.enabled)
                        loss, _ = loss_fn(lp, mb, global_seqs, global_toks)
                    if not eval_mode:
                        # FSDP averages gradients over ranks; the losses are already global
                        # means, so the sum over ranks is wanted: undo the average.
                        (loss * self.dp_size).backward()
                    loss_sum += loss.detach().double().cpu()
            step_metrics = {
                "loss": float(self._all_reduce(loss_sum)),
                "global_valid_seqs": float(global_seqs),
                "global_valid_toks": float(global_toks),
                "lr": self.optimizer.param_groups[0]["lr"],
            }
            if not eval_mode:
                step_metrics["grad_norm"] = self._clip_and_step(params)
            for k, v in step_metrics.items():
                metrics.setdefault(k, []).append(v)
        return metrics

    def _clip_and_step(self, params: list[torch.nn.Parameter]) -> float:
        max_norm = self.config.max_grad_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
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

    def save_checkpoint(self, path: str) -> None:
        """HF safetensors weights (``from_pretrained``-loadable) + optimiser + scheduler.

        Full (unsharded) state dicts are gathered to rank 0, which writes everything. With LoRA
        the weights are the merged model and the adapters go to ``path/adapter`` (``lora.py``).
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.model, options=opts)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            if self.lora:
                lora.save_lora_checkpoint(self.model, weights, path)
            else:
                self.model.save_pretrained(path, state_dict=weights)
            torch.save(optim, os.path.join(path, OPTIMIZER_FILE))
            torch.save(self.scheduler.state_dict(), os.path.join(path, SCHEDULER_FILE))
        if self.dp_size > 1:
            dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote (every rank reads ``path``)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if self.lora:
            # The base weights are those of config.model, frozen: only the adapters are read.
            opts = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.model, lora.load_adapter_state_dict(path), options=opts)
        else:
            # from_pretrained resolves tied and renamed weights the way HF saved them.
            saved = AutoModelForCausalLM.from_pretrained(path, dtype=self.config.model.torch_dtype)
            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, saved.state_dict(), options=opts)
        opts = StateDictOptions(full_state_dict=True)
        optim = torch.load(os.path.join(path, OPTIMIZER_FILE), weights_only=False)
        set_optimizer_state_dict(self.model, self.optimizer, optim, options=opts)
        self.scheduler.load_state_dict(torch.load(os.path.join(path, SCHEDULER_FILE)))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
