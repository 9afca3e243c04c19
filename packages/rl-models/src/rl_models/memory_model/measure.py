"""What autograd keeps of one forward pass, decoder layer by decoder layer: the measurement
the memory model's activation terms are checked against (``tests/test_memory_model.py``).

Every tensor autograd saves for the backward pass goes through a
``torch.autograd.graph.saved_tensors_hooks`` pack hook; each storage is counted once (a view
saved twice is one tensor in memory) and parameters not at all. A storage is a layer's when only
that layer's forward saved it; one saved outside the layers, or by several of them (Hugging
Face's rotary tables, computed once per model), is model-wide. What only a layer's RMSNorms
save is counted apart: the model counts a norm's input and output, not what it keeps beside
them, which depends on the kernel. Integer and boolean tensors (routing indices, masks) are
counted apart from floating-point ones: the model's per-layer terms are floats.

``python -m rl_models.memory_model.measure megatron CASES`` measures the ``GPTModel`` the
Megatron backend builds (``megatron/parallel.py``) on one CPU rank, for each case of a JSON
list of ``[config, rows, width, dtype]``, and prints the counts as JSON. It runs where
megatron-core is installed: the isolated ``mcore`` environment (``rl_distributed.venvs``), not
the driver's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Saved:
    """Bytes autograd saved in one forward pass."""

    layers: list[int]  # floating-point bytes each decoder layer alone saved, but for its norms'
    norms: list[int]  # floating-point bytes only the RMSNorms of each decoder layer saved
    shared: int  # floating-point bytes saved outside the layers, or by more than one
    other: int  # integer and boolean bytes, anywhere


def _is_norm(module: torch.nn.Module) -> bool:
    """An RMSNorm: torch's (what Megatron's layers get, ``megatron/parallel.py``) or one of
    the Hugging Face families' own."""
    return isinstance(module, torch.nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")


def saved_bytes(
    model: torch.nn.Module, layers: Sequence[torch.nn.Module], forward: Callable[[], object]
) -> Saved:
    """Run ``forward`` (a forward pass of ``model``) and count what autograd saves in each of
    ``layers``, apart from what their RMSNorms save (the memory model counts a norm's input and
    output, not what it keeps beside them)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where: dict[str, int | None] = {"layer": None, "norms": 0}  # the running layer; norm depth
    # storage address -> (bytes, floating point, the layers that saved it, whether only norms did)
    kept: dict[int, tuple[int, bool, set[int | None], list[bool]]] = {}
    # Every saved tensor, held until the count is done: storages are told apart by address,
    # and one freed during the forward (its graph node dropped) could hand its address to a
    # later storage, which would then be counted as the same one.
    held: list[torch.Tensor] = []

    def enter(i: int | None = None, norm: bool = False):
        def hook(*_):
            if norm:
                where["norms"] += 1
            else:
                where["layer"] = i

        return hook

    def leave(norm: bool = False):
        def hook(*_):
            if norm:
                where["norms"] -= 1
            else:
                where["layer"] = None

        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(enter(i))
        layer.register_forward_hook(leave())
    for module in model.modules():
        if _is_norm(module):
            module.register_forward_pre_hook(enter(norm=True))
            module.register_forward_hook(leave(norm=True))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        held.append(t)
        if storage.data_ptr() not in params:
            nbytes, floating = storage.nbytes(), t.is_floating_point()
            entry = kept.setdefault(storage.data_ptr(), (nbytes, floating, set(), [True]))
            entry[2].add(where["layer"])
            entry[3][0] &= where["norms"] > 0
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    held.clear()
    per_layer, norms, shared, other = [0] * len(layers), [0] * len(layers), 0, 0
    for nbytes, floating, savers, only_norms in kept.values():
        (layer,) = savers if len(savers) == 1 else (None,)
        if not floating:
            other += nbytes
        elif layer is None:
            shared += nbytes
        elif only_norms[0]:
            norms[layer] += nbytes
        else:
            per_layer[layer] += nbytes
    return Saved(per_layer, norms, shared, other)


def hf_config(spec: dict):
    """The transformers config of ``spec``, a ``config.json`` dict."""
    from transformers import AutoConfig

    hf = dict(spec)
    return AutoConfig.for_model(hf.pop("model_type"), **hf)


def hf_saved(spec: dict, ids: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> Saved:
    """A Hugging Face model built from ``spec`` (a ``config.json`` dict), run on ``ids`` with
    the padding ``mask`` the DTensor worker passes (``policy/forward.py``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=dtype)
    return saved_bytes(model, model.model.layers, lambda: model(input_ids=ids, attention_mask=mask))


def megatron_saved(spec: dict, rows: int, width: int, dtype: torch.dtype) -> Saved:
    """The Megatron backend's ``GPTModel`` of ``spec`` on one CPU rank (gloo), run on ``rows``
    full rows of ``width`` tokens with the inputs its worker builds (``megatron/forward.py``)."""
    import torch.distributed as dist

    from rl_distributed.batched_data_dict import BatchedDataDict
    from rl_models.megatron import cpu_shim
    from rl_models.megatron.convert import GPTLayout
    from rl_models.megatron.forward import make_inputs
    from rl_models.megatron.parallel import build_gpt, init_model_parallel
    from rl_models.policy.config import MegatronConfig

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cpu_shim.apply()
    config = hf_config(spec)
    init_model_parallel(MegatronConfig(), GPTLayout.from_hf_config(config))
    gpt = build_gpt(config, dtype, MegatronConfig())
    # The loader would fill the weights; here they only need to be finite, so that each
    # token's router picks its top k experts as trained weights would.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    ids = torch.randint(1, spec["vocab_size"], (rows, width), generator=generator)
    batch = BatchedDataDict(input_ids=ids, input_lengths=torch.full((rows,), width))
    inputs = make_inputs(batch, packed=False)
    positions = torch.arange(width)[None].expand(rows, -1)

    def forward():
        return gpt(input_ids=inputs.input_ids, position_ids=positions, attention_mask=inputs.mask)

    return saved_bytes(gpt, gpt.decoder.layers, forward)


def main(argv: list[str] | None = None) -> None:
    """``megatron CASES``: CASES a JSON list of ``[config, rows, width, dtype]``; prints the
    JSON list of their ``Saved`` counts."""
    backend, cases = argv or sys.argv[1:]
    if backend != "megatron":
        raise SystemExit(f"only megatron is measured in a process of its own, not {backend!r}")
    saved = [
        asdict(megatron_saved(spec, rows, width, getattr(torch, dtype)))
        for spec, rows, width, dtype in json.loads(cases)
    ]
    print(json.dumps(saved))


if __name__ == "__main__":
    main()
