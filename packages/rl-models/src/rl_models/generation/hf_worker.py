"""The Hugging Face generation worker: one data-parallel rank of ``HfGeneration``.

Holds a ``transformers`` causal LM (built as the policy builds it, from the same model config
and seed) and samples with ``sampling.sample``. Implements ``GenerationWorker``, so ``refit``
streams the policy's weights into it bucket by bucket. For a LoRA policy it can take adapters
instead of merged weights: ``enable_lora_adapters`` adds peft LoRA layers to its model once,
after which a refit sends only the adapter tensors.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable
from typing import Any

import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.config import GenerationConfig, check_one_lora_policy
from rl_models.generation.interfaces import (
    GenerationWorker,
    IncompleteRefitError,
    StaleWeightsError,
    check_generate_input,
    stop_strings_of,
)
from rl_models.generation.sampling import StopStrings, sample
from rl_models.generation.seeds import seeds_of
from rl_models.modeling.build import build_model
from rl_models.modeling.checkpoint_views import CheckpointViews, FusedCoverage
from rl_models.modeling.config import ModelConfig
from rl_models.modeling.moe_routes import require_routers
from rl_models.weight_transfer.buckets import TensorSpec
from rl_models.weight_transfer.channels import ChannelReceiver
from rl_models.weight_transfer.shared_memory import (
    MappedRegion,
    RegionLayout,
    create_region,
    remove_region,
)


def load_tokenizer(path: str | None):
    """The tokenizer under ``path``, or None when there is none to load."""
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


class HfGenerationWorker(ChannelReceiver, GenerationWorker):
    def __init__(self, config: dict[str, Any], model: dict[str, Any]) -> None:
        self.config = GenerationConfig.model_validate(config)
        model_config = ModelConfig.model_validate(model)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        rank = int(os.environ.get("RANK", "0"))
        # The policy's builder and seed, so a model from hf_config starts with its weights.
        model = build_model(model_config, self.config.seed)
        self.model = model.eval().requires_grad_(False).to(self.device)
        # Refits send weights under in-memory names (DTensor) or checkpoint names (Megatron:
        # one tensor per expert, which transformers fuses in memory); both land here.
        self.weights = CheckpointViews(self.model)
        self.params = self.weights.params
        if self.config.record_routed_experts:  # refused now rather than at the first generate
            require_routers(self.model, "generation.record_routed_experts")
        self.tokenizer = load_tokenizer(self.config.tokenizer or model_config.path)
        self.stop_token_ids = self._stop_token_ids()
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        # Only for batches without per-row seeds (``HfGeneration`` always sends them; see
        # ``rl_models.generation.seeds``): this generator's state is lost when the worker stops.
        self.generator = torch.Generator(self.device).manual_seed(self.config.seed + rank)
        self.version = 0
        # Between the first weight loaded and set_weight_version the model is a mix of two
        # versions; a refit that fails midway leaves it so, and generate then refuses.
        self.updating = False
        # The parts of fused parameters this refit wrote: set_weight_version refuses one that
        # wrote some experts of a parameter but not all (the others would stay stale).
        self.refit_writes = FusedCoverage()
        self.region: MappedRegion | None = None  # shared-memory channel: our weights live here
        self.owns_region = False  # this worker created the region file (and unlinks it)
        self.lora: Any = None  # the policy's LoraConfig once adapters were added

    def _stop_token_ids(self) -> list[int]:
        """The configured ids, else the tokenizer's EOS, else ``config.json``'s eos_token_id.

        ``generation_config.json`` is never read.
        """
        configured = self.config.sampling.stop_token_ids
        if configured is not None:
            return list(configured)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self,
        data: BatchedDataDict,
        greedy: bool = False,
        expected_weight_version: int | None = None,
    ) -> BatchedDataDict:
        if self.updating:
            raise IncompleteRefitError(self.version, expected_weight_version)
        if expected_weight_version is not None and expected_weight_version != self.version:
            raise StaleWeightsError(self.version, expected_weight_version)
        check_generate_input(data)
        base = self.config.sampling.stop_strings
        per_row = stop_strings_of(data)  # validated: a bare str is not split into characters
        stop_strings = StopStrings(self.tokenizer, [base + list(s or []) for s in per_row])
        out = sample(
            self.model,
            data["input_ids"],
            data["input_lengths"],
            self.config.sampling,
            greedy=greedy,
            stop_token_ids=self.stop_token_ids,
            stop_strings=stop_strings,
            pad_token_id=self.pad_token_id,
            generator=self.generator,
            row_seeds=seeds_of(data),
            static_kv=self.config.static_kv_decode,
            record_routes=self.config.record_routed_experts,
        )
        result = BatchedDataDict(
            output_ids=out.output_ids,
            logprobs=out.logprobs,
            generation_lengths=out.generation_lengths,
            unpadded_sequence_lengths=data["input_lengths"].cpu().long() + out.generation_lengths,
            truncated=out.truncated,
        )
        if out.routed_experts is not None:
            result["routed_experts"] = out.routed_experts
        if out.first_top_ids is not None:  # sampling.first_token_logprobs asked for them
            result["first_token_top_ids"] = out.first_top_ids
            result["first_token_top_logprobs"] = out.first_top_logprobs
        return result

    def get_pad_token_id(self) -> int:
        """What right-pads ``output_ids``: the tokenizer's pad id, else 0."""
        return self.pad_token_id

    def prepare_for_generation(self) -> None:
        self.model.to(self.device)

    def finish_generation(self) -> None:
        """Colocated with a policy on an accelerator: give its memory back."""
        if self.config.colocated and self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    # -- weights (GenerationWorker) ------------------------------------------------------------

    def prepare_for_weight_update(self) -> None:
        self.prepare_for_generation()
        self.updating = True
        self.refit_writes = FusedCoverage()

    @torch.no_grad()
    def load_named_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the model (every receive channel ends here): a
        parameter's in-memory name, or a checkpoint name whose tensor is a slice of a fused
        parameter (``modeling.checkpoint_views``)."""
        self.updating = True  # until set_weight_version stamps the finished refit
        for name, tensor in named:
            target = self.weights.slice(name)
            if target is None:
                raise KeyError(f"refit sent weight {name!r}, which the generation model lacks")
            if target.view.shape != tensor.shape:
                raise ValueError(
                    f"refit sent {name!r} of shape {tuple(tensor.shape)}; the generation model's "
                    f"is {tuple(target.view.shape)}"
                    + ("" if target.param == name else f" (a slice of {target.param!r})")
                )
            target.view.copy_(tensor)
            self.refit_writes.add(name, target)

    def enable_lora_adapters(self, lora: dict[str, Any]) -> None:
        """Add the policy's LoRA adapters (``policy.lora``) to the model, once: from here on a
        refit loads ``lora_A``/``lora_B`` tensors (and once the unmerged base layers) under the
        names ``policy.lora.inject_adapters`` gives them. The next refit must send them all."""
        from rl_models.modeling.lora import LoraConfig, inject_adapters

        config = LoraConfig.model_validate(lora)
        if self.lora is not None:
            check_one_lora_policy(self.lora, config)
            return
        if self.region is not None:
            raise RuntimeError(
                "the generator's weights live in a shared-memory region laid out for merged "
                "weights; adapters cannot be added to it (keep one policy.lora.refit per run)"
            )
        self.updating = True  # the adapters are zero until the refit that follows fills them
        inject_adapters(self.model, config)
        self.model.eval().requires_grad_(False).to(self.device)
        self.weights.refresh()
        self.params = self.weights.params
        self.lora = config

    def set_weight_version(self, version: int) -> None:
        """Stamp a finished refit, unless it left part of a fused parameter unwritten (then
        the model stays marked as updating, and generate refuses until a complete refit)."""
        gaps = self.refit_writes.gaps()
        if gaps:
            raise RuntimeError(
                f"refit to weight version {version} wrote only part of fused parameters of the "
                "generation model; the rest would keep old weights: " + "; ".join(gaps)
            )
        self.refit_writes = FusedCoverage()
        self.version = version
        self.updating = False

    def get_weight_version(self) -> int:
        return self.version

    def get_weights(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter by HF name, on the host (checks and debugging)."""
        return {name: p.detach().cpu().clone() for name, p in self.params.items()}

    # -- the shared-memory channel (``weight_transfer/shared_memory.py``) ----------------------

    def weight_region_layout(self, specs: list[TensorSpec]) -> RegionLayout:
        """The region layout for the policy's export ``specs`` in which this model's parameters
        can be views: a tensor that is a slice of a fused parameter (a checkpoint-named expert)
        sits where that parameter keeps it, the parameter laid out whole."""

        def place(spec: TensorSpec) -> tuple[str, int, int] | None:
            try:
                target = self.weights.slice(spec.name)
            except ValueError:
                return None  # map_weight_region then says why
            run = None if target is None else target.contiguous_bytes
            if run is None:
                return None
            whole = target.whole
            return target.param, run[0], whole.numel() * whole.element_size()

        return RegionLayout.of(specs, place)

    def _region_segments(self, layout: RegionLayout) -> tuple[dict[str, int], str | None]:
        """Where each parameter the region holds starts in it (bytes), or why this model's
        parameters cannot be views of a region with ``layout``."""
        if self.device.type != "cpu":
            return {}, f"the generation model is on {self.device}, not in host memory"
        starts: dict[str, int] = {}
        coverage = FusedCoverage()
        for slot in layout.slots:
            try:
                target = self.weights.slice(slot.name)
            except ValueError as e:
                return {}, str(e)
            if target is None:
                return {}, f"the region holds {slot.name!r}, which the generation model lacks"
            dtype = str(target.view.dtype).removeprefix("torch.")
            if tuple(target.view.shape) != slot.shape or dtype != slot.dtype:
                return {}, (
                    f"the region holds {slot.name!r} as {slot.dtype} {slot.shape}; the generation "
                    f"model's is {dtype} {tuple(target.view.shape)}"
                )
            run = target.contiguous_bytes
            start = None if run is None else slot.offset - run[0]
            if start is None or starts.setdefault(target.param, start) != start:
                return {}, (
                    f"the region holds {slot.name!r} where the generation model's "
                    f"{target.param!r} does not keep it (lay it out with weight_region_layout)"
                )
            earlier = coverage.add(slot.name, target)
            if earlier is not None:
                return {}, (
                    f"the region holds {earlier!r} and {slot.name!r}, which are (partly) the "
                    f"same elements of the generation model's {target.param!r}"
                )
        gaps = coverage.gaps()
        if gaps:
            return {}, (
                "the region does not hold all of fused parameters of the generation model (a "
                "refit would leave the rest stale): " + "; ".join(gaps)
            )
        return starts, None

    @torch.no_grad()
    def map_weight_region(
        self, path: str | None, layout: RegionLayout
    ) -> tuple[str | None, str | None]:
        """Make the parameters named in ``layout`` views of a shared weight region (a fused
        parameter whose slices the region holds under checkpoint names: the whole of it).

        ``path`` None: create the region and copy the current weights in (one parameter at a
        time, each freed as it moves, so the model is never held twice); else map the region
        another worker of this group created (its contents are about to be overwritten by the
        refit). Returns ``(path, None)``, or ``(None, reason)`` when this model cannot share
        (other dtypes, not on the host, a layout that splits a fused parameter); then nothing
        changed.
        """
        starts, reason = self._region_segments(layout)
        if reason is not None:
            return None, reason
        region = self.region
        if region is not None and region.path == path and region.digest == layout.digest:
            return path, None
        self.updating = True  # parameters are about to point at memory the policy writes
        created = path is None
        if created:
            try:
                path = create_region(layout.nbytes)
            except OSError as e:  # e.g. ENOSPC: /dev/shm smaller than the model
                self.updating = False  # nothing changed: the weights are still whole
                return None, f"cannot create a {layout.nbytes}-byte region in shared memory ({e})"
            atexit.register(remove_region, path)
        region = MappedRegion(path, layout)
        for name, start in starts.items():
            param = self.params[name]
            nbytes = param.numel() * param.element_size()
            view = region.tensor[start : start + nbytes].view(param.dtype).reshape(param.shape)
            if created:
                view.copy_(param)
            param.data = view
        self._release_region()
        self.region, self.owns_region = region, created
        return path, None

    def commit_weight_region(self, path: str, digest: str, version: int) -> None:
        """End a shared-memory refit: the policy has written the region; check that it is the
        one these parameters map, with the same layout, and stamp ``version``."""
        region = self.region
        if region is None or region.path != path or region.digest != digest:
            mapped = None if region is None else f"{region.path} ({region.digest})"
            raise RuntimeError(
                f"refit committed weight region {path} ({digest}) but this worker maps {mapped}"
            )
        self.set_weight_version(version)

    def unlink_weight_region(self, path: str) -> None:
        """Remove the name of the region this worker created, once every process that uses it
        has mapped it: the parameters keep their memory, and no kill of any process can leave
        the region behind in ``/dev/shm`` (its pages go with the last mapping)."""
        region = self.region
        if region is None or region.path != path or not self.owns_region:
            raise RuntimeError(f"weight region {path} was not created by this worker")
        remove_region(path)

    def _release_region(self) -> None:
        if self.region is not None and self.owns_region:
            remove_region(self.region.path)
        self.region, self.owns_region = None, False

    def shutdown(self) -> None:
        self._release_region()  # the memory itself goes once no process maps it
