"""A policy worker for Hugging Face causal LMs, sharded with FSDP2 (DTensor) across its ranks.

One process per rank; ranks meet through ``torch.distributed`` (gloo on CPU, NCCL on GPU)
from the ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables the worker group sets. Without
``WORLD_SIZE`` (or with 1) the worker runs alone, unsharded, in the calling process. The
training loop and micro-batching are ``PolicyWorker``'s (``base_worker.py``).

The ranks form a ``("dp", "tp")`` mesh, ``dtensor.tensor_parallel_size`` ranks along ``tp``
(consecutive ranks, as the driver's layout numbers them): with more than one, the model is
first split by tensor (and sequence) parallelism (``tensor_parallel.py``), then FSDP2 shards
it over ``dp``. The ``tp`` ranks of one ``dp`` rank get the same micro-batches and compute the
same losses; counts and metrics are reduced over ``dp`` only (``dp_group``).

With ``dtensor.context_parallel_size`` > 1 the mesh is ``("dp", "cp", "tp")`` instead: the
``cp`` ranks of one ``dp`` rank get the same micro-batches and split every row along the
sequence between them (``context_parallel.py``), each of them split by tensor parallelism when
``tp`` > 1 (its own heads and columns of its share of the tokens); FSDP2 shards over the
``dp`` and ``cp`` dimensions as one, since every rank's gradients are its own tokens' share.

Sharded, the model is built on the meta device and each rank materialises and loads only its
own shards (``build.py``). The reference policy, when enabled, is built the same way and runs
under the same sharding and precision as the policy, so the two agree exactly at step 0.

With ``lora.enabled`` the model is a ``peft`` model (see ``lora.py``): only the adapters train,
the reference policy is the same model with its adapters switched off (no copy), and a
checkpoint holds the merged model plus the adapters. (peft wraps a materialised model, so with
LoRA each rank builds the whole base model before sharding it.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.interfaces import Logprobs, LossFunction, Scores, loss_input_type
from rl_models.modeling import lora
from rl_models.modeling.build import build_model
from rl_models.modeling.moe_routes import require_routers
from rl_models.modeling.precision import compute_dtype
from rl_models.policy import (
    checkpoint,
    context_parallel,
    context_parallel_rules,
    offload,
    tensor_parallel,
)
from rl_models.policy.base_worker import (  # noqa: F401 (microbatch_args: re-export)
    PolicyWorker,
    init_distributed,
    local_device,
    microbatch_args,
)
from rl_models.policy.checkpoint import OPTIMIZER_FILE, SCHEDULER_FILE  # noqa: F401 (re-export)
from rl_models.policy.config import PolicyConfig, worker_config
from rl_models.policy.forward import (
    LOSS_OUTPUTS,
    ForwardOptions,
    Output,
    SequenceScores,
    StateValues,
    TokenLogprobs,
    TopkLogprobs,
    align_values,
    routes_replayed,
)
from rl_models.policy.weight_export import DTensorWeightExporter, WeightExportMethods

#: The mesh with context parallelism: data, context and tensor parallel (tp fastest).
MESH_3D = ("dp", "cp", "tp")


class DTensorPolicyWorker(WeightExportMethods, PolicyWorker):
    """Holds one rank of the policy (and optionally a frozen reference copy)."""

    def __init__(self, config: PolicyConfig | dict[str, Any]) -> None:
        self.config = worker_config("dtensor", config)
        self.device = local_device()
        init_distributed(self.device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.tp_size = self.config.dtensor.tensor_parallel_size
        self.cp_size = self.config.dtensor.context_parallel_size
        if world % (self.tp_size * self.cp_size):
            raise ValueError(
                f"{world} policy workers cannot be split into groups of "
                f"dtensor.tensor_parallel_size={self.tp_size} x "
                f"dtensor.context_parallel_size={self.cp_size}: make the worker count a "
                "multiple of their product"
            )
        self.dp_size = world // (self.tp_size * self.cp_size)
        #: Whether the model is distributed at all (FSDP2, and tensor parallel with tp > 1).
        self.sharded = world > 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.lora = self.config.lora.enabled
        self.forward_options = ForwardOptions.of(self.config)
        if self.sharded:
            self._make_meshes(world)
        # None: compute in the weights' dtype ("auto" on a device without native bfloat16).
        self.compute_dtype = compute_dtype(self.config.mixed_precision, self.device.type)

        self.model = self._build_policy()
        if self.config.router_replay:
            require_routers(self.model, "policy.router_replay")
        self.reference: torch.nn.Module | None = None
        if self.config.reference_policy.enabled and not self.lora:
            self.reference = self._build_reference()
        self._make_optimizer()

    def _make_meshes(self, world: int) -> None:
        """The device mesh (one for the policy and its reference) and FSDP2's part of it."""
        from torch.distributed.device_mesh import init_device_mesh

        kind = self.device.type
        if self.cp_size == 1 and self.tp_size == 1:
            self._mesh = init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
            self._fsdp_mesh = self._mesh
            return
        if self.cp_size == 1:
            self._mesh = init_device_mesh(
                kind, (self.dp_size, self.tp_size), mesh_dim_names=tensor_parallel.MESH_DIMS
            )
            self.dp_group = self._mesh["dp"].get_group()
            self._fsdp_mesh = self._mesh["dp"]
            return
        # tp fastest, then cp, then dp: the driver's layout (worker_sharding) numbers them so.
        self._mesh = init_device_mesh(
            kind, (self.dp_size, self.cp_size, self.tp_size), mesh_dim_names=MESH_3D
        )
        self.dp_group = self._mesh["dp"].get_group()
        group = context_parallel.ContextGroup.of(self._mesh["cp"].get_group())
        self.forward_options = dataclasses.replace(self.forward_options, context=group)
        # FSDP2 over the dp and cp dimensions as one (each rank's gradients are its tokens'
        # share), a dimension of the same mesh as tp so that it composes with the tensor
        # parallel plan's DTensors. DeviceMesh._flatten is how torch names such a dimension
        # (its own 2-D/3-D parallel examples use it).
        self._fsdp_mesh = self._mesh["dp", "cp"]._flatten("dp_cp")

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.config.activation_checkpointing:
            # Recompute each layer's activations in backward: memory for compute.
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()
            if self.lora:  # frozen embeddings: checkpointed layers still need grad inputs
                model.enable_input_require_grads()
        return model

    def _build_policy(self) -> torch.nn.Module:
        if self.lora:
            # peft wraps (and initialises adapters on) a materialised model.
            model = build_model(self.config.model, self.config.seed)
            model = lora.wrap_with_lora(self._prepare(model), self.config.lora, self.config.seed)
            return self._shard(model.to(self.device))
        shard = self._shard if self.sharded else None
        model, seed = self.config.model, self.config.seed
        return build_model(model, seed, self.device, shard=shard, prepare=self._prepare)

    def _build_reference(self) -> torch.nn.Module:
        """The initial policy again, sharded and cast like the policy (same numerics)."""
        shard = self._shard if self.sharded else None
        ref = build_model(self.config.model, self.config.seed, self.device, shard=shard)
        ref = ref.eval().requires_grad_(False)
        if self.config.reference_policy.offload_to_cpu:
            offload.move_module(ref, torch.device("cpu"), copy=False)
        return ref

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """Tensor parallel over ``tp`` (when > 1), then FSDP2: each decoder layer, then the
        rest, sharded over ``dp`` (over ``dp`` and ``cp`` as one with context parallelism;
        works on gloo).

        A peft model is sharded the same way (its decoder layers are those of the base model);
        FSDP2 takes the mix of frozen base and trainable adapter parameters in one group.
        """
        if not self.sharded:
            return model
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.tp_size > 1:
            sequence_parallel = self.config.dtensor.sequence_parallel
            tensor_parallel.parallelize(model, self._mesh["tp"], sequence_parallel)
        if self.cp_size > 1:
            context_parallel_rules.check_model(model, self.cp_size)
        mesh = self._fsdp_mesh
        precision = MixedPrecisionPolicy()
        if self.compute_dtype is not None:
            # Parameters are all-gathered in the compute dtype (half the traffic); gradients
            # are reduced and kept in the weights' dtype.
            precision = MixedPrecisionPolicy(
                param_dtype=self.compute_dtype, reduce_dtype=torch.float32
            )
        base = model.get_base_model() if self.lora else model
        for layer in getattr(getattr(base, "model", base), "layers", []):
            fully_shard(layer, mesh=mesh, mp_policy=precision)
        return fully_shard(model, mesh=mesh, mp_policy=precision)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 compute for an unsharded model (FSDP2 casts sharded ones itself)."""
        if self.compute_dtype is None or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _dummy_logits(self, model: torch.nn.Module) -> torch.Tensor:
        """A forward pass over nothing of use, which takes part in the collectives; its
        logits (this rank's vocabulary slice under tensor parallelism). One token per tp
        rank, so that sequence parallelism leaves none of them without one."""
        ids = torch.zeros(1, self.tp_size, dtype=torch.long, device=self.device)
        logits = model(input_ids=ids).logits
        return logits.to_local() if hasattr(logits, "to_local") else logits

    def _checked(self, output: Output) -> Output:
        """``output``, once it is checked to be one this worker's model has."""
        kind = self.config.model.kind
        if output.model_kind != kind:
            raise ValueError(f"a {kind} model has no {output.what} (model.kind: {kind})")
        return output

    def _loss_output(self, loss_fn: LossFunction) -> Output:
        """The output ``loss_fn`` is given, from its declared ``input_type``."""
        kind = self.config.model.kind
        declared = loss_input_type(
            loss_fn, default=Scores if kind == "sequence_classification" else Logprobs
        )
        output = LOSS_OUTPUTS[declared]
        if output.model_kind != kind:
            fitting = [d.__name__ for d, o in LOSS_OUTPUTS.items() if o.model_kind == kind]
            raise ValueError(
                f"a {kind} model (model.kind: {kind}) trains on losses of input_type "
                f"{' or '.join(fitting)}, not {type(loss_fn).__name__} ({declared.__name__})"
            )
        return output

    def _forward(
        self, model: torch.nn.Module, mb: BatchedDataDict, output: Output
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``output`` of one micro-batch on this device (a tensor, or for ``TopkLogprobs`` a
        (values, ids) pair)."""
        with self._autocast():
            out = output(model, mb, self.forward_options)
        # Losses and metrics in at least the weights' precision, whatever the compute dtype.
        dtype = self.config.model.torch_dtype

        def promoted(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.promote_types(t.dtype, dtype)) if t.is_floating_point() else t

        return tuple(map(promoted, out)) if isinstance(out, tuple) else promoted(out)

    # -- inference ---------------------------------------------------------------------------

    def _replaying(self, model: torch.nn.Module, mb: BatchedDataDict) -> Any:
        """Where ``router_replay`` is on, the block in which ``model`` replays ``mb``'s routes."""
        return routes_replayed(model, mb, self.forward_options)

    @torch.no_grad()
    def _per_row(
        self, model: torch.nn.Module, data: BatchedDataDict, output: Output, replay: bool = True
    ) -> Any:
        """Per-row ``output`` of ``data``, in its row order, padded back to its width (a
        tensor, or for ``TopkLogprobs`` a (values, ids) pair of tensors). ``replay``: with
        ``router_replay``, the generator's routes are replayed (not for the reference, whose
        own routing the KL penalty compares against)."""
        output = self._checked(output)
        model.eval()
        width = data["input_ids"].shape[1]
        (mbs,), restore = self._steps(data, data.size, self.config.lp_micro_batch_size, False)
        out = []
        for mb in self._same_count(mbs):
            if mb is None or mb.size == 0:
                self._dummy_logits(model)  # keep FSDP's all-gathers in step with the peers
                continue
            mb = mb.to(self.device)
            with self._replaying(model, mb) if replay else contextlib.nullcontext():
                values = self._forward(model, mb, output)
            pair = isinstance(values, tuple)
            parts = values if pair else (values,)
            if output.per_token:  # [B, S, ...]: pad to the batch's width
                parts = tuple(
                    F.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1])) for v in parts
                )
            out.append(tuple(v.cpu() for v in parts))
        results = tuple(torch.cat(column) for column in zip(*out, strict=True))
        if restore is not None:
            results = tuple(r[torch.tensor(restore)] for r in results)
        return results if pair else results[0]

    def get_logprobs(self, data: BatchedDataDict, at_loss_tokens: bool = False) -> BatchedDataDict:
        output = TokenLogprobs(at_loss_tokens=at_loss_tokens)
        return BatchedDataDict({"logprobs": self._per_row(self.model, data, output)})

    def get_topk_logprobs(self, data: BatchedDataDict, k: int) -> BatchedDataDict:
        """``{"topk_logprobs": [B, S, k], "topk_ids": [B, S, k]}``: at every position ``t`` the
        ``k`` most likely tokens of the distribution that predicts token ``t`` (descending,
        log-softmax over the whole vocabulary at ``logprob_temperature``) and their ids; 0 at
        position 0 and on padding. What a distillation teacher reports (``teacher_topk_*``)."""
        values, ids = self._per_row(self.model, data, TopkLogprobs(k))
        return BatchedDataDict({"topk_logprobs": values, "topk_ids": ids})

    def get_scores(self, data: BatchedDataDict) -> BatchedDataDict:
        """``{"scores": [B, num_labels]}`` of a sequence classifier (reward model)."""
        return BatchedDataDict({"scores": self._per_row(self.model, data, SequenceScores())})

    def get_values(self, data: BatchedDataDict) -> BatchedDataDict:
        """A value model's ``{"values": [B, S], "final_values": [B]}``: ``values[:, t]`` values
        the state that chose token ``t`` (0 at position 0 and on padding); ``final_values`` the
        state after the row's last token (what a truncated response is bootstrapped from)."""
        state = self._per_row(self.model, data, StateValues())
        lengths = data["input_lengths"]
        last = (lengths - 1).clamp(min=0).long()
        return BatchedDataDict(
            {
                "values": align_values(state, lengths),
                "final_values": state.gather(1, last[:, None])[:, 0],
            }
        )

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, at_loss_tokens: bool = False
    ) -> BatchedDataDict:
        output = TokenLogprobs(at_loss_tokens=at_loss_tokens)
        if self.lora and self.config.reference_policy.enabled:
            # The frozen base weights are the initial policy: switch the adapters off.
            with self.model.disable_adapter():
                lp = self._per_row(self.model, data, output, replay=False)
            return BatchedDataDict({"reference_logprobs": lp})
        if self.reference is None:
            raise RuntimeError("this policy has no reference model (reference_policy.enabled)")
        offload.move_module(self.reference, self.device, copy=False)
        try:
            lp = self._per_row(self.reference, data, output, replay=False)
            return BatchedDataDict({"reference_logprobs": lp})
        finally:
            if self.config.reference_policy.offload_to_cpu:
                offload.move_module(self.reference, torch.device("cpu"), copy=False)

    # -- training ----------------------------------------------------------------------------

    def _run_step(
        self,
        step: list[BatchedDataDict],
        loss_fn: LossFunction,
        output: Output,
        global_seqs: torch.Tensor,
        global_toks: torch.Tensor,
        eval_mode: bool,
    ) -> torch.Tensor:
        """Forward (and backward) of one step's micro-batches; the sum of their losses."""
        loss_sum = torch.zeros((), dtype=torch.float64)
        self._loss_metrics = []
        mbs = self._same_count(step)
        for i, mb in enumerate(mbs):
            if self.sharded and not eval_mode:
                # Gradients accumulate unsharded on each rank and are reduce-scattered once,
                # after the step's last micro-batch: one collective per step rather than per
                # micro-batch, at the price of unsharded gradients held until then.
                self.model.set_requires_gradient_sync(i == len(mbs) - 1)
            with contextlib.ExitStack() as replaying:
                if mb is None:
                    loss = self._dummy_logits(self.model).sum() * 0.0
                else:
                    mb = mb.to(self.device)
                    # Spans the backward too: recomputed activations replay the same routes.
                    replaying.enter_context(self._replaying(self.model, mb))
                    out = self._forward(self.model, mb, output)
                    loss, metrics = loss_fn(
                        out, TrainBatch.from_transport(mb), global_seqs, global_toks
                    )
                    self._loss_metrics.append(metrics)
                if not eval_mode:
                    # FSDP averages gradients over its ranks; the losses are already global
                    # means, so the sum over ranks is wanted: undo the average. (The tp ranks of
                    # a dp rank compute the same loss; tensor parallelism adds nothing up twice.
                    # The cp ranks compute the same loss too, but each one's gradients are its
                    # own tokens' share: FSDP's ranks include them.)
                    (loss * (self._fsdp_mesh.size() if self.sharded else 1)).backward()
            loss_sum += loss.detach().double().cpu()
        return loss_sum

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.tp_size > 1:  # parameters on two meshes: see tensor_parallel.grad_norm
            norm = tensor_parallel.clip_grads(params, self.config.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            return norm
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm or math.inf)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        return float(norm)

    # -- weight export (refit: rl_models.generation.refit) -------------------------------------

    def _weight_exporter(self) -> DTensorWeightExporter:
        return DTensorWeightExporter(self.model, self.lora, self.rank)

    def save_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        """HF safetensors weights (``from_pretrained``-loadable) into ``path``; optimiser and
        scheduler state into ``training_state_dir`` (``path`` when not given).

        ``checkpoint.sharded``: every rank writes its own shards (see ``checkpoint.py``).
        Otherwise full state dicts are gathered to rank 0, which writes everything; with LoRA
        the weights are the merged model and the adapters go to ``path/adapter`` (``lora.py``).
        """
        state_dir = training_state_dir or path
        if self.config.checkpoint.sharded:
            checkpoint.save_sharded(self.model, self.optimizer, path, state_dir, self.rank)
        else:
            weights = checkpoint.save_full_training_state(
                self.model, self.optimizer, state_dir, self.rank
            )
            if self.rank == 0 and self.lora:
                lora.save_lora_checkpoint(self.model, weights, path)
            elif self.rank == 0:
                self.model.save_pretrained(path, state_dict=weights)
        if self.rank == 0:
            checkpoint.save_scheduler(self.scheduler, state_dir)
        if self.sharded:
            dist.barrier()

    def load_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        """Restore what ``save_checkpoint`` wrote, in either layout (every rank reads both
        directories)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        state_dir = training_state_dir or path
        if checkpoint.is_sharded(state_dir):
            checkpoint.load_sharded(self.model, self.optimizer, path, state_dir)
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
            checkpoint.load_full_optimizer(self.model, self.optimizer, state_dir)
        self._restore_configured_kernels()
        checkpoint.load_scheduler(self.scheduler, state_dir)

    def _hf_class(self) -> type[torch.nn.Module]:
        """The Hugging Face model class (FSDP2 subclasses it on the fly; peft wraps it)."""
        model = self.model.get_base_model() if self.lora else self.model
        for cls in type(model).__mro__:
            if cls.__module__.startswith("transformers."):
                return cls
        return type(model)
