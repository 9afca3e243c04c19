"""NeMo RL's ``env.<task>`` sections, as our ``env.<task>: {kind, config}`` entries."""

from __future__ import annotations

from typing import Any

from rl_algorithms.nemo_compat.core import Context
from rl_algorithms.nemo_compat.datasets import _puzzle_env, _puzzle_task

# NeMo's GDPO math environment's rewards (in NeMo's order of names, which its
# ``reward_weights`` follow) as our built-in reward functions (rl_envs.tag_rewards).
MULTI_REWARD_FUNCTIONS = [
    {"function": "answer_exact", "name": "correctness"},
    {"function": "think_answer_format", "name": "format"},
    {"function": "answer_is_integer", "name": "integer"},
]

# NeMo's reward-model environment keys -> RewardModelEnvConfig's (rl_envs.reward_model_env).
REWARD_MODEL_KEYS = {
    "model_name": "model_path",
    "batch_size": "batch_size",
    "max_model_len": "max_length",
}
REWARD_MODEL_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32"}
REWARD_MODEL_DTYPES |= {"fp32": "float32", "float16": "float16", "fp16": "float16"}


def env_group(ctx: Context, prefix: str) -> None:
    """NeMo's ``env.<task>`` -> our ``env.<task>: {kind, config}``."""
    puzzle = _puzzle_task(ctx) if ctx.algorithm == "grpo" else None
    named = _named_by_data(ctx)
    for task, spec in (ctx.get("env") or {}).items():
        base = f"env.{task}"
        leaves = list(ctx.leaves(base))
        if puzzle is not None and task != puzzle:
            for key, value in leaves:
                ctx.ignore(key, value, f"NeMo's sliding-puzzle script starts env.{puzzle} only")
        elif puzzle is None and named and task not in named:
            # (e.g. env.math inherited from a parent recipe whose data now names another)
            for key, value in leaves:
                ctx.ignore(key, value, "no dataset names it (data.*.env_name): NeMo starts none")
        elif isinstance(spec, dict) and "game_config" in (spec.get("cfg") or {}):
            _puzzle_env(ctx, task, spec["cfg"], leaves)
        elif isinstance(spec, dict) and "reward_model_cfg" in spec:
            _reward_model_env(ctx, task, leaves)
        elif task == "math_multi_reward" and isinstance(spec, dict):
            _multi_reward_env(ctx, task, leaves)
        elif task == "math" and isinstance(spec, dict):
            config = _verifier_keys(
                ctx,
                task,
                leaves,
                hf_math_verify="our math environment uses HF's Math-Verify too",
                other="a math-environment option with no counterpart here",
            )
            ctx.set_ours(base, {"kind": "math", "config": config})
        else:
            for key, value in leaves:
                ctx.refuse(
                    key,
                    value,
                    f"environment {task!r} has no counterpart here (known: math, "
                    "math_multi_reward, reward_model, and the sliding puzzle of "
                    "grpo_sliding_puzzle.yaml)",
                )


def _named_by_data(ctx: Context) -> set[str]:
    """The environments the recipe's datasets name (``env_name`` of data.train / validation,
    or data.default's); empty when none names one."""
    default = ctx.get("data.default") or {}
    entries = [ctx.get(f"data.{split}") for split in ("train", "validation")]
    specs = [{**default, **entry} for entry in entries if isinstance(entry, dict)]
    return {spec["env_name"] for spec in specs if spec.get("env_name")}


def _verifier_keys(
    ctx: Context, task: str, leaves: list[tuple[str, Any]], hf_math_verify: str, other: str
) -> dict[str, Any]:
    """The keys NeMo's math environments share: ``num_workers`` (ours too), and
    ``math_verify_impl``, ignored at ``hf_math_verify`` (saying why: ``hf_math_verify``) and
    refused otherwise; any other key is refused (``other``). Our environment's config."""
    config: dict[str, Any] = {}
    for key, value in leaves:
        field_name = key.rsplit(".", 1)[1]
        if field_name == "num_workers":
            config["num_workers"] = value
            ctx.record(key, value, f"env.{task}.config.num_workers")
        elif field_name == "math_verify_impl" and value == "hf_math_verify":
            ctx.ignore(key, value, hf_math_verify)
        elif field_name == "math_verify_impl":
            ctx.refuse(
                key,
                value,
                f"would verify answers with NeMo's {value!r}; our math environments use HF's "
                "Math-Verify (hf_math_verify)",
            )
        else:
            ctx.refuse(key, value, other)
    return config


def _multi_reward_env(ctx: Context, task: str, leaves: list[tuple[str, Any]]) -> None:
    """NeMo's GDPO math environment: three rewards on the text in ``<answer>`` tags (equal to
    the ground truth as text, an integer, the think-then-answer layout) -> ``kind:
    reward_functions`` with the same three as built-ins, weight 1 each (GDPO's
    ``reward_weights`` weigh their advantages)."""
    config = _verifier_keys(
        ctx,
        task,
        leaves,
        hf_math_verify="its rewards compare the tagged answer as text",
        other="an option of NeMo's GDPO math environment with no counterpart",
    )
    config["functions"] = [dict(f) for f in MULTI_REWARD_FUNCTIONS]
    base = f"env.{task}"
    ctx.set_ours(base, {"kind": "reward_functions", "config": config})


def _reward_model_env(ctx: Context, task: str, leaves: list[tuple[str, Any]]) -> None:
    """NeMo's reward-model environment (a Bradley-Terry sequence classifier scoring each
    conversation) -> ours, ``kind: reward_model``. NeMo runs it as a policy-like worker group
    (its dtensor_cfg, batching, resources); here it is one model in the environment's process,
    so those keys only place or shard it."""
    base = f"env.{task}"
    config: dict[str, Any] = {}
    model = ctx.get(f"{base}.model_name")
    for key, value in leaves:
        field = key.removeprefix(f"{base}.")
        if field in REWARD_MODEL_KEYS:
            config[REWARD_MODEL_KEYS[field]] = value
            ctx.record(key, value, f"{base}.config.{REWARD_MODEL_KEYS[field]}")
        elif field == "precision":
            if value not in REWARD_MODEL_DTYPES:
                ctx.refuse(key, value, "would run the reward model in an unknown precision")
                continue
            config["dtype"] = REWARD_MODEL_DTYPES[value]
            ctx.record(key, value, f"{base}.config.dtype")
        elif field == "tokenizer.name":
            if value == model:
                ctx.ignore(key, value, "the reward model's own tokenizer, read from its files")
            else:
                ctx.refuse(key, value, "would score with another tokenizer than the model's")
        elif field == "reward_model_cfg.reward_model_type":
            if value == "bradley_terry":
                ctx.ignore(key, value, "ours is a one-logit (Bradley-Terry) classifier too")
            else:
                ctx.refuse(key, value, f"would score with a {value!r} reward model")
        elif field == "checkpoint_path" and value is not None:
            ctx.refuse(key, value, "would load the reward model's weights from a checkpoint")
        elif field in ("dtensor_cfg.tensor_parallel_size", "dtensor_cfg.context_parallel_size"):
            if value == 1:
                ctx.ignore(key, value, "no sharding")
            else:
                ctx.refuse(key, value, "would shard the reward model across GPUs")
        elif field == "processor":
            ctx.ignore(key, value, "the prompts' processor is data.*.processor here")
        else:
            ctx.ignore(
                key,
                value,
                "how NeMo places, shards or trains its reward-model worker; ours scores in the "
                "environment's process and never trains",
            )
    ctx.set_ours(base, {"kind": "reward_model", "config": config})
