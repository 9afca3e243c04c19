"""A policy worker whose model is a Megatron-core ``GPTModel``, tensor and pipeline parallel.

Runs in the isolated ``mcore`` environment (see ``rl_models.megatron``). The model is built
from the Hugging Face config of a Llama/Qwen2-family model and given its weights through
``rl_models.megatron.convert``, so it computes the same function as the HF model the DTensor
worker would load from the same ``PolicyConfig`` (same path, or same ``hf_config`` and seed).

``world = pp * dp * tp`` ranks (``PolicyConfig.megatron`` gives tp and pp), numbered as
Megatron numbers them; each holds the layers of its pipeline stage, tensor-parallel shards of
them (``parallel.py``). All ranks of one model replica get the same data and return the same
results (log-probs and metrics come from the last pipeline stage); the driver keeps one copy.

Micro-batching, packing plans and the training loop are ``PolicyWorker``'s (shared with the
DTensor worker, ``rl_models.policy.base_worker``); a step's forward/backward (``_run_step``), the gradient sync and clipping, and the log-prob pass are this
class's own (``forward.py``): losses see the global batch's valid sample and token counts,
all-reduced over the data-parallel group only (``_all_reduce``), and the gradients of the
micro-batch losses are summed over that group, which makes the update the gradient of the
global-batch mean whatever the parallel layout.

Sequence packing works with tensor and pipeline parallelism alike: every stage rebuilds the
packed row and its block-diagonal mask from the same micro-batch, and stages send each other
the shape of every activation (``variable_seq_lengths``), so packed rows of different lengths
flow through the pipeline.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from transformers import AutoModelForCausalLM

from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.interfaces import (
    GatheredLogprobs,
    Logits,
    Logprobs,
    LossFunction,
    LossInput,
    LossTokenLogprobs,
    LossTokenLogprobsAndEntropy,
    loss_input_type,
)
from rl_models.megatron import cpu_shim
from rl_models.megatron.convert import GPTLayout
from rl_models.megatron.forward import (
    HALF,
    Inputs,
    broadcast_from_last_stage,
    make_inputs,
    objects_from_last_stage,
    run_pipeline,
)
from rl_models.megatron.loading import (
    LoadStats,
    Piece,
    load_from_fresh_init,
    load_from_safetensors,
    shard_plan,
)
from rl_models.megatron.moe import MoeAuxLoss
from rl_models.megatron.parallel import (
    ShardFiller,
    build_gpt,
    clip_grads,
    gather_hf_state,
    init_model_parallel,
    sync_grads,
)
from rl_models.megatron.training_state import check_parallel_layout, save_parallel_layout
from rl_models.megatron.weight_export import MegatronWeightExporter, tp_gather_to
from rl_models.modeling.build import hf_config_of
from rl_models.policy.base_worker import PolicyWorker, init_distributed, local_device
from rl_models.policy.checkpoint import OPTIMIZER_FILE, SCHEDULER_FILE
from rl_models.policy.config import PolicyConfig, worker_config
from rl_models.policy.weight_export import WeightExportMethods

#: The inputs a loss may declare here, and what ``run_pipeline`` gives for each: every
#: position's log-probs (which a ``LossTokenLogprobs`` loss accepts), with the entropy beside
#: them, or the whole logits.
LOSS_INPUT_OUTPUT: dict[type[LossInput], Literal["logprobs", "entropy", "logits"]] = {
    Logprobs: "logprobs",
    LossTokenLogprobs: "logprobs",
    LossTokenLogprobsAndEntropy: "entropy",
    Logits: "logits",
}


class MegatronPolicyWorker(WeightExportMethods, PolicyWorker):
    """One rank of a Megatron ``GPTModel`` replica (and of its optional reference copy)."""

    def __init__(self, config: PolicyConfig | dict[str, Any]) -> None:
        # The config refuses what this worker does not support (LoRA, activation checkpointing,
        # mixed precision, sharded checkpoints): see MegatronPolicyConfig.
        self.config = worker_config("megatron", config)
        self.device = local_device()
        # Alone, outside a worker group, Megatron still wants a process group.
        init_distributed(self.device, always=True)
        cpu_shim.apply()
        self.hf_config = hf_config_of(self.config.model)
        self.layout = GPTLayout.from_hf_config(self.hf_config)
        self.ranks = init_model_parallel(self.config.megatron, self.layout)
        if self.device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(self.config.seed)
        # dp_size is what the shared loop (_steps, batch-size checks) divides by.
        self.dp_size = self.ranks.dp
        # What the shared loop's reductions (counts, metrics) run over: the replicas only.
        self.dp_group = parallel_state.get_data_parallel_group()
        self.rank = dist.get_rank()
        self.tied = self.layout.tied_embeddings
        # Only this rank's shard is ever allocated, and filled from slices: of the
        # safetensors files (model.path), or of the HF initialisation run module by module
        # (model.hf_config: the exact weights the DTensor worker would start from).
        self.model = self._empty_gpt()
        self.load_stats = self._fill(self.model, self.config.model.path)
        self.model.to(self.device)
        self.reference: torch.nn.Module | None = None
        if self.config.reference_policy.enabled:
            self.reference = self._empty_gpt().eval().requires_grad_(False)
            self.reference.load_state_dict(self.model.state_dict())
            ref_device = "cpu" if self.config.reference_policy.offload_to_cpu else self.device
            self.reference.to(ref_device)
        self._make_optimizer()

    # -- set-up --------------------------------------------------------------------------------

    def _empty_gpt(self) -> torch.nn.Module:
        """This rank's ``GPTModel`` piece, allocated (on the CPU) but not initialised."""
        return build_gpt(self.hf_config, self.config.model.torch_dtype, self.config.megatron)

    def _plan(self) -> list[Piece]:
        r = self.ranks
        return shard_plan(
            self.layout,
            vocab_size=self.hf_config.vocab_size,
            tp=r.tp,
            tp_rank=r.tp_rank,
            pp=r.pp,
            pp_rank=r.pp_rank,
            ep=r.ep,
            ep_rank=r.ep_rank,
        )

    def _fill(self, gpt: torch.nn.Module, path: str | None) -> LoadStats:
        """Fill ``gpt`` (this rank's piece) from the safetensors in ``path``, or from a fresh
        initialisation when ``path`` is None; what it cost, counted."""
        fill = ShardFiller(gpt)
        dtype, tp = self.config.model.torch_dtype, self.ranks.tp
        if path is not None:
            stats = load_from_safetensors(path, self._plan(), self.layout, tp, dtype, fill)
        else:
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(self.hf_config, dtype=dtype)
            hf.tie_weights()
            stats = load_from_fresh_init(hf, self.config.seed, self._plan(), self.layout, tp, fill)
        fill.check()
        return stats

    def weight_load_stats(self) -> dict[str, int]:
        """What filling this rank's shard read or initialised (bytes; see ``LoadStats``), and
        the number of weights in the rank's model piece, for comparison."""
        s = self.load_stats
        piece = sum(p.numel() for p in self.model.parameters())
        return {
            "bytes_read": s.bytes_read,
            "bytes_initialised": s.bytes_initialised,
            "peak_full_bytes": s.peak_full_bytes,
            "bytes_emitted": s.bytes_emitted,
            "model_piece_numel": piece,
        }

    def _inputs(self, mbs: list[BatchedDataDict]) -> list[Inputs]:
        multiple = self.ranks.tp if self.config.megatron.sequence_parallel else 1
        packed = self.config.sequence_packing.enabled
        return [make_inputs(mb.to(self.device), packed, multiple) for mb in mbs if mb.size > 0]

    # -- inference -----------------------------------------------------------------------------

    @torch.no_grad()
    def _logprobs(
        self, model: torch.nn.Module, data: BatchedDataDict, at_loss_tokens: bool = False
    ) -> torch.Tensor:
        """``[B, S]`` log-probs of ``data`` in its row order; ``at_loss_tokens``: zeroed off
        the loss's tokens (the pipeline computes every position's; the values kept are the
        same)."""
        model.eval()
        width = data["input_ids"].shape[1]
        (mbs,), restore = self._steps(
            data, data.size, self.config.lp_micro_batch_size, training=False
        )
        inputs = self._inputs(mbs)
        dtype = self.config.model.torch_dtype
        rows = sum(i.data.size for i in inputs)
        result = torch.zeros(rows, width, dtype=torch.float32 if dtype in HALF else dtype)
        offset = 0

        def keep(lp: torch.Tensor, inp: Inputs) -> None:
            nonlocal offset
            result[offset : offset + lp.shape[0], : lp.shape[1]] = lp.cpu()
            offset += lp.shape[0]

        run_pipeline(
            model,
            inputs,
            keep,
            self.hf_config.vocab_size,
            forward_only=True,
            temperature=self.config.logprob_temperature,
            chunk_size=self.config.logprob_chunk_size,
        )
        # Only the last stage computed them; every rank of the replica returns them.
        result = broadcast_from_last_stage(result.to(self.device)).cpu()
        result = result[torch.tensor(restore)] if restore is not None else result
        if at_loss_tokens:
            wanted = TrainBatch.from_transport(data).loss_token_mask() > 0
            result = torch.where(wanted, result, 0.0)
        return result

    def get_logprobs(self, data: BatchedDataDict, at_loss_tokens: bool = False) -> BatchedDataDict:
        return BatchedDataDict({"logprobs": self._logprobs(self.model, data, at_loss_tokens)})

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, at_loss_tokens: bool = False
    ) -> BatchedDataDict:
        if self.reference is None:
            raise RuntimeError("this policy has no reference model (reference_policy.enabled)")
        self.reference.to(self.device)
        try:
            lp = self._logprobs(self.reference, data, at_loss_tokens)
            return BatchedDataDict({"reference_logprobs": lp})
        finally:
            if self.config.reference_policy.offload_to_cpu:
                self.reference.to("cpu")

    # -- training ------------------------------------------------------------------------------

    def _loss_output(self, loss_fn: LossFunction) -> str:
        """What ``loss_fn`` takes (``LOSS_INPUT_OUTPUT``), by its ``input_type``."""
        declared = loss_input_type(loss_fn)
        if declared is GatheredLogprobs:
            # The vocab-parallel output layer gathers one token per position only.
            raise ValueError(
                f"{type(loss_fn).__name__} has input_type GatheredLogprobs (log-probs at "
                "'teacher_topk_ids'), which backend 'megatron' does not provide; train it with "
                "policy.backend: dtensor"
            )
        if declared not in LOSS_INPUT_OUTPUT:
            raise ValueError(
                f"{type(loss_fn).__name__} has input_type {declared.__name__}, which backend "
                "'megatron' (causal LMs only) does not provide"
            )
        return LOSS_INPUT_OUTPUT[declared]

    def _run_step(
        self,
        step: list[BatchedDataDict],
        loss_fn: LossFunction,
        output: str,
        global_seqs: torch.Tensor,
        global_toks: torch.Tensor,
        eval_mode: bool,
    ) -> torch.Tensor:
        """Forward/backward of one step's micro-batches (``output``: what the loss is given,
        ``LOSS_INPUT_OUTPUT``); their summed loss, on every rank of the replica (the last
        stage computes it)."""
        losses: list[torch.Tensor] = []
        inputs = self._inputs(step)
        megatron = self.config.megatron
        split = self.ranks.tp if megatron.sequence_parallel else 1
        aux = MoeAuxLoss(self.model, megatron.moe_aux_loss_coeff, inputs, self._all_reduce, split)

        metrics: list[dict[str, float]] = []

        def loss_of(values: torch.Tensor, inp: Inputs) -> torch.Tensor:
            seqs, toks = global_seqs.to(values.device), global_toks.to(values.device)
            loss, loss_metrics = loss_fn(values, TrainBatch.from_transport(inp.data), seqs, toks)
            losses.append(loss.detach().double().cpu())
            metrics.append(loss_metrics)
            return loss

        with aux:
            run_pipeline(
                self.model,
                inputs,
                loss_of,
                self.hf_config.vocab_size,
                forward_only=eval_mode,
                logits=output == "logits",
                temperature=self.config.logprob_temperature,
                chunk_size=self.config.logprob_chunk_size,
                entropy=output == "entropy",
                after_forward=aux.after_forward,
            )
        # The loss's own metrics, per micro-batch, on every stage (the driver reads rank 0's);
        # the base class adds them up over the replicas.
        self._loss_metrics = objects_from_last_stage(metrics)
        if aux.enabled and not eval_mode:
            self._loss_metrics.append({"moe_aux_loss": aux.total()})
        loss_sum = torch.stack(losses).sum() if losses else torch.zeros((), dtype=torch.float64)
        return broadcast_from_last_stage(loss_sum.to(self.device))

    def _clip_and_step(self) -> float:
        sync_grads(self.model, self.ranks, self.tied, self.config.megatron.sequence_parallel)
        norm = clip_grads(self.model, self.ranks, self.tied, self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        return norm

    # -- weights and checkpoints ---------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole policy under Hugging Face names (CPU copies), on every rank.

        A collective: every rank must call it (shards are gathered across the replica).
        """
        state = gather_hf_state(self.model, self.layout, self.ranks, to_all=True)
        assert state is not None
        return state

    def _weight_exporter(self) -> MegatronWeightExporter:
        """Stage by stage, layer by layer, gathered onto tensor-parallel rank 0 only; with
        expert parallelism each expert-parallel rank of the first expert group sends its own
        experts (see ``weight_export``).

        Experts are gathered over the tensor-parallel group too: Megatron splits them over an
        expert tensor-parallel group of the same ranks, since ``init_model_parallel`` leaves
        ``expert_tensor_parallel_size`` at its default (the tensor-parallel size).
        """
        r = self.ranks
        gather = tp_gather_to(
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_tensor_model_parallel_src_rank(),
            r.tp,
        )
        return MegatronWeightExporter(
            self.model,
            self.layout,
            tp=r.tp,
            tp_rank=r.tp_rank,
            pp=r.pp,
            pp_rank=r.pp_rank,
            dp_rank=r.dp_rank,
            gather=gather,
            ep=r.ep,
            ep_rank=r.ep_rank,
        )

    def _optimizer_file(self) -> str:
        """One file per model-parallel rank (their optimiser states hold different shards),
        and per expert-parallel rank (each holds the state of other experts)."""
        r = self.ranks
        if r.tp * r.pp * r.ep == 1:
            return OPTIMIZER_FILE
        stem, ext = os.path.splitext(OPTIMIZER_FILE)
        experts = f"-ep{r.ep_rank}" if r.ep > 1 else ""
        return f"{stem}-pp{r.pp_rank}-tp{r.tp_rank}{experts}{ext}"

    def _parallel_sizes(self) -> dict[str, int]:
        r = self.ranks
        return {
            "tensor_parallel_size": r.tp,
            "pipeline_parallel_size": r.pp,
            "expert_parallel_size": r.ep,
        }

    def save_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        """HF safetensors weights (``from_pretrained``-loadable) into ``path``; optimiser and
        scheduler state into ``training_state_dir`` (``path`` when not given).

        Rank 0 writes the gathered weights and the scheduler; each rank of replica 0 (with
        expert parallelism: of the first ``ep`` replicas) writes its own optimiser state.
        Loading needs the same tensor, pipeline and expert parallel sizes for the optimiser
        state (the weights load under any layout), which rank 0 records
        (``training_state.save_parallel_layout``).
        """
        state_dir = training_state_dir or path
        weights = gather_hf_state(self.model, self.layout, self.ranks, to_all=False)
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            os.makedirs(state_dir, exist_ok=True)
            # The weights go in as they are, under their checkpoint names (which, for a
            # mixture of experts, are not the fused names transformers uses in memory); the
            # model itself only supplies the config and the file layout.
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(
                    self.hf_config, dtype=self.config.model.torch_dtype
                )
            hf.save_pretrained(path, state_dict=weights)
            torch.save(self.scheduler.state_dict(), os.path.join(state_dir, SCHEDULER_FILE))
            save_parallel_layout(state_dir, self._parallel_sizes())
        dist.barrier()  # the folders exist before the other ranks write into them
        if self.ranks.holds_whole_model:
            optimizer_file = os.path.join(state_dir, self._optimizer_file())
            torch.save(self.optimizer.state_dict(), optimizer_file)
        dist.barrier()

    def load_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        """Restore what ``save_checkpoint`` wrote (every rank reads both directories); a
        checkpoint saved under other parallel sizes is refused before anything is read."""
        state_dir = training_state_dir or path
        check_parallel_layout(state_dir, self._parallel_sizes(), self._optimizer_file())
        self._fill(self.model, path)  # this rank's slices of the saved safetensors only
        optim = torch.load(os.path.join(state_dir, self._optimizer_file()), weights_only=False)
        self.optimizer.load_state_dict(optim)
        self._restore_configured_kernels()
        self.scheduler.load_state_dict(torch.load(os.path.join(state_dir, SCHEDULER_FILE)))

    def shutdown(self) -> None:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        super().shutdown()  # the process group
