"""Four public models' shapes, the meshes docs/guides/memory.md weighs for them on one node
of 8 x 80 GB GPUs, and the tables it shows, all computed by :mod:`rl_models.memory_model`
(``python -m rl_models.memory_model --doc`` prints them; a test checks the page shows exactly
these)."""

from __future__ import annotations

from typing import Any

from rl_models.memory_model import OVERHEAD, Breakdown, Plan, Shape, breakdown, gib

# Public config.json values of a few models (the keys this module reads), by model name.
SHAPES: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "tie_word_embeddings": False,
    },
    "Qwen2.5-32B": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120,
        "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
        "num_key_value_heads": 8, "tie_word_embeddings": False,
    },
    "Llama-3.1-70B": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "tie_word_embeddings": False,
    },
    "Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "tie_word_embeddings": False,
    },
}  # fmt: skip


# The meshes docs/guides/memory.md weighs for each model on 8 x 80 GB GPUs (the 70B also on
# two nodes), GRPO with a colocated vLLM unless said otherwise (``generator_tp=0``: SFT).
HALF = {"param_bytes": 2, "compute_bytes": 2}
MEGATRON = {"backend": "megatron", "activation_checkpointing": False, **HALF}
# Megatron's attention keeps every head's [row, row] scores (Shape.attention_elements), so its
# rows are short: the 70B's GRPO rows are 2048 tokens (vLLM's max_model_len), one row's worth
# a micro-batch, sequence parallel, vLLM over 8 GPUs; the MoE's SFT rows 1024 tokens, one a
# micro-batch.
MEGATRON_70B = {
    **MEGATRON, "sequence_parallel": True, "micro_batch_tokens": 2048, "sequence_length": 2048,
    "generator_tp": 8,
}  # fmt: skip
SFT_30B = {**MEGATRON, "micro_batch_tokens": 1024, "sequence_length": 1024, "generator_tp": 0}
# GRPO over rows of 32768 tokens (a 1024-token prompt, the rest its answer), one row a
# micro-batch, 16 of them in each of two vLLM engines of tensor parallelism 4.
LONG = {
    "tp": 2, "sequence_parallel": True, "micro_batch_tokens": 32768, "generator_tp": 4,
    "sequences": 16, "sequence_length": 32768,
}  # fmt: skip
# GRPO with router replay: the generator that records routes is Hugging Face's (vLLM's does
# not yet, generation/config.py), one whole bfloat16 model per worker, decoding its 16 rows
# of 4096 tokens at once; the policy is DTensor's (Megatron and context parallelism refuse
# replay, and the DTensor backend has no tensor-parallel plan for MoE layers).
REPLAY = {
    **HALF, "generator": "hf", "micro_batch_tokens": 4096, "sequences": 16,
    "sequence_length": 4096,
}  # fmt: skip
DOC_PLANS: dict[str, list[tuple[str, Plan]]] = {
    "Llama-3.1-8B": [
        ("dtensor dp4 x tp2 (SP)", Plan(tp=2, sequence_parallel=True)),
        ("dtensor dp8", Plan()),
        ("dtensor dp4 x tp2 (SP), 32k rows", Plan(**LONG)),
        (
            "dtensor cp4 x tp2 (SP), 32k rows",
            Plan(cp=4, activation_checkpointing=False, **LONG),
        ),
    ],
    "Qwen2.5-32B": [
        ("dtensor dp8, fp32 master", Plan(generator_tp=4)),
        (
            "dtensor dp2 x tp4 (SP), bf16",
            Plan(tp=4, sequence_parallel=True, generator_tp=4, **HALF),
        ),
    ],
    "Llama-3.1-70B": [
        ("megatron tp8", Plan(tp=8, **MEGATRON_70B)),
        ("megatron tp4 x pp2", Plan(tp=4, pp=2, **MEGATRON_70B)),
        ("megatron tp8 x pp2, 16 GPUs", Plan(gpus=16, tp=8, pp=2, **MEGATRON_70B)),
    ],
    "Qwen3-30B-A3B": [
        ("megatron dp8 (SFT)", Plan(**SFT_30B)),
        ("megatron ep8 (SFT)", Plan(ep=8, **SFT_30B)),
        ("dtensor dp8, HF generator colocated (replay)", Plan(**REPLAY)),
        (
            "dtensor dp4, HF generator on 4 more GPUs (replay)",
            Plan(gpus=4, generator_gpus=4, **REPLAY),
        ),
    ],
}
# Each recipe in examples/configs/ that a plan above sizes: its model and the plan's label.
# The recipe's settings are the plan's (packages/rl-algorithms/tests/test_examples.py).
RECIPES: dict[str, tuple[str, str]] = {
    "grpo_8b_8gpu": ("Llama-3.1-8B", "dtensor dp4 x tp2 (SP)"),
    "grpo_8b_32k_8gpu": ("Llama-3.1-8B", "dtensor cp4 x tp2 (SP), 32k rows"),
    "grpo_32b_8gpu": ("Qwen2.5-32B", "dtensor dp2 x tp4 (SP), bf16"),
    "grpo_70b_16gpu": ("Llama-3.1-70B", "megatron tp8 x pp2, 16 GPUs"),
    "sft_30b_a3b_8gpu": ("Qwen3-30B-A3B", "megatron ep8 (SFT)"),
    "grpo_30b_a3b_8gpu": ("Qwen3-30B-A3B", "dtensor dp4, HF generator on 4 more GPUs (replay)"),
}
PARTS = ("weights", "gradients", "optimizer", "gathered", "activations", "logits")
GEN_PARTS = ("generator_weights", "kv_cache", "refit_buffers")
# The peaks of a colocated run's phases (the module docstring of rl_models.memory_model).
PHASES = ("training", "refit", "generation", "start")


def plan_of(name: str, label: str) -> Plan:
    """The plan ``label`` of model ``name``."""
    plans = dict(DOC_PLANS[name])
    if label not in plans:
        raise KeyError(f"{name} has no plan {label!r} (it has {list(plans)})")
    return plans[label]


def recipe_plan(recipe: str) -> tuple[str, Plan]:
    """The model and the plan of the recipe ``examples/configs/<recipe>.yaml``."""
    name, label = RECIPES[recipe]
    return name, plan_of(name, label)


def phases_of(b: Breakdown) -> tuple[str, ...]:
    """The phases ``b`` has a peak in: all four with a generator, training only without (SFT)."""
    return PHASES if b.has_generator else PHASES[:1]


def vllm_range(b: Breakdown, plan: Plan) -> str | None:
    """The range ``generation.vllm.gpu_memory_utilization`` may take, as text; None when the
    plan's generator is not vLLM."""
    if not (b.has_generator and plan.generator == "vllm"):
        return None
    low, high = b.vllm_memory_utilization()
    return f"{low:.2f} to {high:.2f}"


def fit_table() -> str:
    """Markdown: each model's meshes, the peak per GPU of each phase, whether they fit, and
    the recipe that takes the mesh."""
    taken = {(name, label): recipe for recipe, (name, label) in RECIPES.items()}
    rows = [
        "| model | mesh | training GiB | refit GiB | generation GiB | start GiB | fits | recipe |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, plans in DOC_PLANS.items():
        shape = Shape.from_config(SHAPES[name])
        for label, plan in plans:
            b = breakdown(shape, plan)
            peaks = [gib(getattr(b, p)) if p in phases_of(b) else "—" for p in PHASES]
            fits = "yes" if b.fits() else "no"
            recipe = f"`{taken[name, label]}`" if (name, label) in taken else ""
            rows.append(f"| {name} | {label} | {' | '.join(peaks)} | {fits} | {recipe} |")
    return "\n".join(rows)


def breakdown_table(name: str, plan: Plan) -> str:
    """Markdown: one model's parts per GPU under ``plan`` (GiB)."""
    b = breakdown(Shape.from_config(SHAPES[name]), plan)
    parts = PARTS + (GEN_PARTS if b.has_generator else ())
    rows = ["| part | GiB per GPU |", "|---|---|"]
    rows += [f"| {p.replace('_', ' ')} | {gib(getattr(b, p))} |" for p in parts]
    rows.append(f"| overhead (each process) | {gib(OVERHEAD)} |")
    rows += [f"| **{phase} peak** | **{gib(getattr(b, phase))}** |" for phase in phases_of(b)]
    if vllm := vllm_range(b, plan):
        rows.append(f"| vLLM gpu_memory_utilization | {vllm} |")
    return "\n".join(rows)


def doc_tables() -> str:
    """What docs/guides/memory.md shows between its markers (a test compares the two)."""
    out = [fit_table()]
    for recipe in RECIPES:
        name, plan = recipe_plan(recipe)
        out += [f"**`{recipe}.yaml`: {name}, {RECIPES[recipe][1]}**", breakdown_table(name, plan)]
    return "\n\n".join(out)
