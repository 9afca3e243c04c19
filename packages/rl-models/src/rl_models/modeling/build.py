"""Building the model a ``ModelConfig`` names without any rank holding all of it.

Policies (``policy/``, ``megatron/``) and generators (``generation/``) build the same model from
the same config and seed, so a generator starts with its policy's weights.

The model is first built on the ``meta`` device (shapes only, no memory), then sharded (FSDP2's
``fully_shard``, passed in as ``shard``), then given storage for this rank's shards only
(``to_empty``), and finally filled:

- **fresh weights** (``model.hf_config``): ``init_weights_by_module`` runs the model's own
  Hugging Face initialisation one module at a time, post-order, from ``seed``. A module's
  parameters exist in full only while it is initialised (the largest one is the embedding),
  and each rank keeps its slices. Every rank and every sharding draws the same numbers, so
  the seed gives the same model on one rank as on many.
- **pretrained weights** (``model.path``): each rank reads only its slices straight from the
  safetensors files (``torch.distributed.checkpoint``'s Hugging Face reader).

Unsharded, a pretrained model is simply ``from_pretrained``; a fresh one goes through the same
meta build and module-wise initialisation, so it equals the sharded one. So does a value or
reward model built from a causal LM's files: its new head is drawn from the seed like fresh
weights, the rest is read from the files (``new_head_weights``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from rl_models.modeling.config import ModelConfig
from rl_models.modeling.random_streams import seeded_generators

logger = logging.getLogger(__name__)


def _auto_class_and_kwargs(cfg: ModelConfig) -> tuple[Any, dict[str, Any]]:
    if cfg.kind == "sequence_classification":
        return AutoModelForSequenceClassification, {"num_labels": cfg.num_labels}
    if cfg.kind == "value":
        # No dropout before the value head: it would make the values the critic is trained
        # on differ from the ones it is asked for.
        return AutoModelForTokenClassification, {"num_labels": 1, "classifier_dropout": 0.0}
    return AutoModelForCausalLM, {}


#: The head a model of each kind adds to a causal LM: a value or reward model built from a
#: causal LM's files starts it fresh, from the seed; one built from files that hold it (a
#: trained reward model) loads it.
NEW_HEAD_WEIGHTS = {"value": ("score.",), "sequence_classification": ("score.",)}


def stored_weight_names(path: str) -> set[str] | None:
    """The names of the weights in ``path``'s safetensors files (their headers only), or None
    where it has none (``pytorch_model.bin`` alone)."""
    from safetensors import safe_open

    names: set[str] = set()
    files = sorted(Path(path).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names if files else None


def new_head_weights(cfg: ModelConfig) -> tuple[str, ...]:
    """The prefixes of the weights the seed draws because ``cfg``'s files lack them: its
    kind's head when no stored weight has that name (a causal LM's files), else none. Files
    that are not safetensors go through ``from_pretrained``, which draws a missing head
    itself and says so."""
    prefixes = NEW_HEAD_WEIGHTS.get(cfg.kind, ())
    if cfg.path is None or not prefixes:
        return ()
    stored = stored_weight_names(cfg.path)
    if stored is None or any(name.startswith(prefixes) for name in stored):
        return ()
    return prefixes


def hf_config_of(cfg: ModelConfig) -> PretrainedConfig:
    """The Hugging Face config of the model ``cfg`` names."""
    _, extra = _auto_class_and_kwargs(cfg)
    if cfg.path is not None:
        hf_config = AutoConfig.from_pretrained(cfg.path, **extra)
    else:
        hf = dict(cfg.hf_config or {})
        hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf, **extra)
    for key, value in extra.items():  # from_pretrained drops keys the config class lacks
        setattr(hf_config, key, value)
    hf_config._attn_implementation = cfg.attn_implementation
    return hf_config


def build_model(
    cfg: ModelConfig,
    seed: int,
    device: torch.device | str = "cpu",
    shard: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """The model ``cfg`` names, on ``device``: a causal LM or a sequence classifier; fresh
    weights (``cfg.hf_config``) are drawn from ``seed``.

    ``prepare`` runs on the meta-device model before sharding (e.g. to switch on activation
    checkpointing); ``shard`` shards it (see the module docstring). Without ``shard`` the
    whole model is built on this rank.
    """
    auto, _ = _auto_class_and_kwargs(cfg)
    # A value or reward model built from a causal LM's files goes the meta way below even
    # unsharded, so that its new head is drawn from ``seed`` the same way on one rank as on
    # many (``from_pretrained`` would draw it from torch's global generator, which torch seeds
    # at random in every process).
    new_head = new_head_weights(cfg)
    if shard is None and cfg.path is not None and not new_head:
        # The config as hf_config_of makes it: it sets keys (a critic's classifier_dropout)
        # that a model's __init__ would refuse as keyword arguments.
        model = auto.from_pretrained(
            cfg.path,
            config=hf_config_of(cfg),
            dtype=cfg.torch_dtype,
            attn_implementation=cfg.attn_implementation,
        )
        return (prepare(model) if prepare else model).to(device)
    with torch.device("meta"):
        model = auto.from_config(hf_config_of(cfg), dtype=cfg.torch_dtype)
    if prepare is not None:
        model = prepare(model)
    if shard is not None:
        model = shard(model)
    model.to_empty(device=device)
    if shard is None:  # to_empty replaces an unsharded model's parameters, tied ones apart
        model.tie_weights()
    # Buffers computed at construction (rotary frequencies) are re-made here too.
    init_weights_by_module(model, seed)
    if cfg.path is not None:
        load_hf_weights(model, cfg.path, may_lack=new_head)
    return model


def _post_order(module: torch.nn.Module, owner: PreTrainedModel):
    """``(module, the innermost Hugging Face model holding it)``, children before parents."""
    if isinstance(module, PreTrainedModel):
        owner = module
    for child in module.children():
        yield from _post_order(child, owner)
    yield module, owner


@torch.no_grad()
def init_weights_by_module(
    model: torch.nn.Module,
    seed: int,
    on_init: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """Hugging Face's initialisation of every module, one at a time, from ``seed``.

    The numbers are drawn on the CPU, so they do not depend on the device either: sharded
    (DTensor) and device-resident parameters and buffers are swapped for full-size CPU
    temporaries while their module is initialised, then copied in (a sharded tensor keeps its
    slices only; a ``meta`` tensor keeps nothing). Every rank draws the same numbers in the
    same order, so the shards fit. ``on_init(real, full)`` sees each temporary right after its
    module's initialisation (the Megatron worker cuts its slices from it there).

    Hugging Face's initialisers draw from torch's global generators, so they run in forks of
    them, seeded: the caller's generators are left as they were. The CUDA one matters to the
    families whose initialisation of a module draws into a child's weight (GPT-2's ``c_proj``),
    which is back on its device by then; such a family's draws on a GPU follow the seed, but
    are not the CPU's numbers.
    """
    cuda = [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else []
    with seeded_generators(seed, cuda):
        hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
        for module, owner in _post_order(hf_model, hf_model):
            _init_module(module, owner, on_init)


def _init_module(
    module: torch.nn.Module,
    owner: PreTrainedModel,
    on_init: Callable[[torch.Tensor, torch.Tensor], None] | None,
) -> None:
    """``owner``'s initialisation of ``module`` alone, on full-size CPU temporaries (see
    ``init_weights_by_module``)."""
    swapped: dict[tuple[str, str], torch.Tensor] = {}
    for kind in ("_parameters", "_buffers"):
        tensors = getattr(module, kind)
        for name, t in list(tensors.items()):
            if t is None:
                continue
            t._is_hf_initialized = False  # HF's guarded init skips tensors flagged done
            if isinstance(t, DTensor) or t.device.type != "cpu":
                full = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                swapped[(kind, name)] = t
                tensors[name] = (
                    torch.nn.Parameter(full, requires_grad=t.requires_grad)
                    if kind == "_parameters"
                    else full
                )
    owner._init_weights(module)
    for (kind, name), real in swapped.items():
        full = getattr(module, kind)[name].detach()
        if on_init is not None:
            on_init(real, full)
        if isinstance(real, DTensor):
            local = real.to_local()
            mine = distribute_tensor(
                full.to(local.device), real.device_mesh, real.placements, src_data_rank=None
            )
            local.copy_(mine.to_local())
        else:
            real.copy_(full)
        getattr(module, kind)[name] = real


def load_hf_weights(model: torch.nn.Module, path: str, may_lack: tuple[str, ...] = ()) -> None:
    """Read this rank's slices of every weight from the safetensors files in ``path``.

    A weight tied to another (the output layer to the embedding) is absent from the files and
    loaded through its twin. Weights whose names start with one of ``may_lack`` keep their
    initialisation when the files do not hold them.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    stored = stored_weight_names(path)
    if stored is None:
        raise ValueError(f"{path}: no *.safetensors files to load the weights from")
    state = get_model_state_dict(model)
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    # For each state key, the name the files hold it under (itself, or a tied twin's).
    file_name = {key: key for key in state if key in stored}
    for names in names_of.values():
        in_state = [n for n in names if n in state]
        in_files = [n for n in names if n in stored]
        for key in in_state if in_files else []:
            file_name[key] = in_files[0]
    absent = sorted(set(state) - set(file_name))
    missing = [k for k in absent if not k.startswith(may_lack)]
    if missing:
        raise ValueError(f"{path}: the safetensors files lack the weights {missing}")
    if absent:
        # What from_pretrained's load report would say. A head stored under another name (a
        # value head saved as v_head.*) shows up here as weights that nothing loads.
        unused = sorted(k for k in stored - set(file_name.values()) if not k.startswith("lm_head."))
        logger.warning(
            "%s holds no %s: drawn from the seed instead%s",
            path,
            absent,
            f"; the files' {unused} are not loaded" if unused else "",
        )
    wanted = {file_name[key]: state[key] for key in file_name}
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(path))
    loaded = {key: wanted[file_name[key]] for key in file_name}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
