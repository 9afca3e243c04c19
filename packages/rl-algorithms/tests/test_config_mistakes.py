"""Config mistakes that used to pass validation and fail only once workers ran are refused when
the config is built (before Ray starts), naming the key."""

from pathlib import Path
from typing import Literal

import pytest
import ray

from rl_algorithms import cli
from rl_distributed.config import ConfigError
from rl_models.backends import GENERATION_BACKENDS, Backend
from rl_models.generation.config import GenerationConfig, lora_refit

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "configs" / "sft_cpu.yaml"
GRPO_RECIPE = RECIPE.parent / "grpo_math_cpu.yaml"
PPO_RECIPE = RECIPE.parent / "ppo_math_cpu.yaml"
DISTILL_RECIPE = RECIPE.parent / "distill_math_cpu.yaml"


@pytest.fixture(autouse=True)
def ray_must_not_start(monkeypatch):
    """Building a config never starts Ray (an earlier test may have left one running, so
    whether Ray is up says nothing: starting it fails the test instead)."""

    def start(*args, **kwargs):
        raise AssertionError("Ray was started while the config was built")

    monkeypatch.setattr(ray, "init", start)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.train.path=examples/data/no_such_file.jsonl",
            r"data\.train\.path: .*file not found",
        ),
        (
            "+policy.optimizer.kwargs.weight_decy=0.1",
            r"policy\.optimizer\.kwargs: .*AdamW has no argument 'weight_decy'; did you mean",
        ),
        (
            "+policy.scheduler={name: CosineAnnealingLR}",
            r"policy\.scheduler\.kwargs: .*CosineAnnealingLR needs 'T_max'",
        ),
        (
            "policy.sequence_packing.algorithm=best_fit",
            r"policy\.sequence_packing\.algorithm: .*unknown packing algorithm 'best_fit'",
        ),
        (
            "policy.lora.target_modules=[all-linear,q_proj]",
            r"policy\.lora\.target_modules: .*'all-linear' already covers the others",
        ),
        ("data.prompt_template=Solve", r"data\.prompt_template: .*must contain \{\} or \{prompt\}"),
    ],
)
def test_mistake_is_refused_naming_the_key_before_ray_starts(override, message):
    algorithm = cli.load_algorithm("sft")
    argv = ["--config", str(RECIPE), "tokenizer.path=/tokenizer", override]
    with pytest.raises(ConfigError, match=message):
        cli.build_config(algorithm, argv)


def test_all_linear_and_a_warmup_chain_are_accepted():
    algorithm = cli.load_algorithm("sft")
    argv = [
        "--config",
        str(RECIPE),
        "tokenizer.path=/tokenizer",
        "policy.lora.enabled=true",
        "policy.lora.target_modules=[all-linear]",
        "+tokenizer.chat_template_kwargs={enable_thinking: false}",
        "+policy.scheduler=[{name: LinearLR, kwargs: {start_factor: 0.1, total_iters: 5}},"
        " {name: CosineAnnealingLR, kwargs: {T_max: 15}}, {milestones: [5]}]",
    ]
    config = cli.build_config(algorithm, argv)
    assert config.policy.lora.target_modules == ["all-linear"]
    assert config.tokenizer.chat_template.kwargs == {"enable_thinking": False}
    assert [type(s).__name__ for s in config.policy.scheduler] == [
        "SchedulerConfig",
        "SchedulerConfig",
        "SchedulerMilestones",
    ]


def test_a_checkpoint_metric_grpo_never_logs_is_refused_with_the_logged_ones(capsys):
    # `val_reward` used to be accepted and never logged: top-k then kept the newest k.
    argv = ["grpo", "--config", str(GRPO_RECIPE), "tokenizer.path=/tokenizer", "--print-config"]
    assert cli.main([*argv, "checkpointing.metric_name=val_reward"]) == 2
    err = capsys.readouterr().err
    assert "checkpointing.metric_name 'val_reward' is not a metric this algorithm logs" in err
    assert "val/accuracy" in err and "train/reward_mean" in err


def test_a_checkpoint_metric_grpo_logs_is_accepted():
    base = ["--config", str(GRPO_RECIPE), "tokenizer.path=/tokenizer"]
    config = cli.build_config(
        cli.load_algorithm("grpo"), [*base, "checkpointing.metric_name=val/accuracy"]
    )
    assert config.checkpointing.metric_name == "val/accuracy"


@pytest.mark.parametrize(("algorithm", "recipe"), [("grpo", GRPO_RECIPE), ("ppo", PPO_RECIPE)])
def test_token_entropy_ranks_checkpoints_only_where_the_entropy_bonus_logs_it(algorithm, recipe):
    loop = cli.load_algorithm(algorithm)
    base = ["--config", str(recipe), "tokenizer.path=/tokenizer"]
    ranked = "checkpointing.metric_name=train/token_entropy"
    with pytest.raises(ConfigError, match="metric_name 'train/token_entropy' is not a metric"):
        cli.build_config(loop, [*base, ranked])
    config = cli.build_config(loop, [*base, "loss_fn.entropy_coef=0.01", ranked])
    assert config.checkpointing.metric_name == "train/token_entropy"


def test_a_vllm_generator_is_planned_for_lora_adapters_at_the_policys_rank():
    base = ["--config", str(GRPO_RECIPE), "tokenizer.path=/tokenizer", "policy.lora.enabled=true"]
    vllm = [
        *base,
        "policy.model.hf_config=null",  # vLLM reads the model from disk
        "policy.model.path=/model",
        "generation={backend: vllm, sampling: {max_new_tokens: 16}}",
    ]
    lora = ["policy.lora.rank=16", "policy.lora.alpha=32"]
    config = cli.build_config(cli.load_algorithm("grpo"), [*vllm, *lora])
    plan = config.generation.plan(config.policy.model, False, config.policy.lora)
    assert plan.config.vllm.max_lora_rank == 16  # the engine starts able to load them
    merged = cli.build_config(cli.load_algorithm("grpo"), [*vllm, "policy.lora.refit=merged"])
    plan = merged.generation.plan(merged.policy.model, False, merged.policy.lora)
    assert plan.config.vllm.max_lora_rank is None
    with pytest.raises(
        ConfigError, match=r"generation\.vllm\.max_lora_rank: 8 is below policy\.lora\.rank: 16"
    ):
        cli.build_config(
            cli.load_algorithm("grpo"), [*vllm, *lora, "generation.vllm.max_lora_rank=8"]
        )


class NoAdaptersGeneration(GenerationConfig):
    """A generation backend of one's own that cannot load LoRA adapters (both built-in ones
    can): ``loads_lora_adapters`` is the base class's False."""

    backend: Literal["no_adapters"] = "no_adapters"


def test_merged_lora_refits_are_chosen_explicitly_never_as_a_silent_fallback():
    """``policy.lora.refit: auto`` sends adapters; with a generator that cannot load them the
    run is refused when its config is built, saying which key to set to what, rather than
    moving the whole model every refit without being asked to."""
    GENERATION_BACKENDS.register(Backend("no_adapters", NoAdaptersGeneration, "x:Y"))
    try:
        base = [
            "--config",
            str(GRPO_RECIPE),
            "tokenizer.path=/tokenizer",
            "policy.lora.enabled=true",
            "generation.backend=no_adapters",
        ]
        grpo = cli.load_algorithm("grpo")
        with pytest.raises(
            ConfigError,
            match=r"policy\.lora\.refit: auto sends LoRA adapters, and generation\.backend: "
            r"no_adapters cannot load them: set policy\.lora\.refit: merged",
        ):
            cli.build_config(grpo, base)
        config = cli.build_config(grpo, [*base, "policy.lora.refit=merged"])
        assert config.generation.backend == "no_adapters"
        assert lora_refit(config.policy.lora, config.generation) == "merged"
    finally:
        GENERATION_BACKENDS.unregister("no_adapters")


def test_rl_loops_take_an_expert_parallel_megatron_policy_which_refits():
    """Each expert-parallel rank streams its own experts (``megatron.weight_export``)."""
    base = ["--config", str(GRPO_RECIPE), "tokenizer.path=/tokenizer", "policy.backend=megatron"]
    expert_parallel = [*base, "policy.megatron.expert_parallel_size=2"]
    config = cli.build_config(cli.load_algorithm("grpo"), expert_parallel)
    assert config.policy.megatron.expert_parallel_size == 2


def test_a_critic_without_a_model_of_its_own_builds_and_refuses_context_parallelism():
    """A critic's model left out (the policy's, with a value head, filled in later) still
    validates, and context parallelism, which cannot split a value head's gradient, is
    refused for the critic by name."""
    from rl_models.policy.config import worker_config

    base = ["--config", str(PPO_RECIPE), "tokenizer.path=/tokenizer"]
    config = cli.build_config(cli.load_algorithm("ppo"), base)
    assert worker_config("dtensor", config.critic).dtensor.context_parallel_size == 1
    with pytest.raises(ConfigError, match=r"critic: .*context_parallel_size=2 .*model\.kind=value"):
        cli.build_config(
            cli.load_algorithm("ppo"), [*base, "critic.dtensor.context_parallel_size=2"]
        )
    # Refusals that read the model's kind name it for a critic without a model too.
    refusals = {
        "critic.lora.enabled=true": r"critic\.lora\.enabled: a critic trains its whole model",
        "critic.dtensor.tensor_parallel_size=2": r"critic: .*model\.kind=value",
    }
    for override, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            cli.build_config(cli.load_algorithm("ppo"), [*base, override])


def test_ppo_takes_the_entropy_bonus_into_its_policy_loss():
    from rl_algorithms.ppo.loop import make_loss
    from rl_models.interfaces import LossTokenLogprobsAndEntropy, loss_input_type

    argv = ["--config", str(PPO_RECIPE), "tokenizer.path=/tokenizer", "loss_fn.entropy_coef=0.02"]
    config = cli.build_config(cli.load_algorithm("ppo"), argv)
    loss_fn = make_loss(config)
    assert loss_fn.config.entropy_coef == 0.02
    # The policy is asked for every token's entropy beside its log-probs.
    assert loss_input_type(loss_fn) is LossTokenLogprobsAndEntropy
    assert "token_entropy" in loss_fn.METRICS


def test_distillation_refuses_an_entropy_bonus_in_its_policy_gradient_part():
    algorithm = cli.load_algorithm("distill")
    base = ["--config", str(DISTILL_RECIPE), "tokenizer.path=/tokenizer"]
    assert cli.build_config(algorithm, base).grpo_loss_fn.entropy_coef == 0
    with pytest.raises(ConfigError, match=r"grpo_loss_fn\.entropy_coef must be 0 in distillation"):
        cli.build_config(algorithm, [*base, "grpo_loss_fn.entropy_coef=0.01"])


def test_supervised_checkpoint_metrics_are_the_losss_own():
    algorithm = cli.load_algorithm("sft")
    base = ["--config", str(RECIPE), "tokenizer.path=/tokenizer"]
    config = cli.build_config(algorithm, [*base, "checkpointing.metric_name=val/num_valid_tokens"])
    assert "train/grad_norm" in config.logged_metrics()
    # DPO's accuracy is no metric of SFT's loss; validation has no gradient norm.
    for name in ("val/accuracy", "val/grad_norm"):
        with pytest.raises(ConfigError, match=rf"metric_name '{name}' is not a metric"):
            cli.build_config(algorithm, [*base, f"checkpointing.metric_name={name}"])


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "+env.arithmetic.config.num_workrs=1",
            "env.arithmetic.config.num_workrs: got 1 — unknown key; did you mean 'num_workers'",
        ),
        (
            "env.arithmetic.config.num_workers=abc",
            "env.arithmetic.config.num_workers: got 'abc' — expected int",
        ),
    ],
)
def test_an_environments_config_mistake_is_one_line_naming_its_own_key(override, line):
    """Not a dump of the whole ``env`` section with the useful part in brackets at its end."""
    algorithm = cli.load_algorithm("grpo")
    argv = ["--config", str(GRPO_RECIPE), "tokenizer.path=/tokenizer", override]
    with pytest.raises(ConfigError) as raised:
        cli.build_config(algorithm, argv)
    problems = str(raised.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].strip().startswith(line), problems
    assert [issue.key for issue in raised.value.errors] == [line.split(":")[0]]


def test_eval_takes_the_main_recipes_generation_section(tmp_path):
    """`rl eval` on the main recipe's model with the main recipe's generation section, every
    key of it (``dtype`` included); the generator holds the model in that dtype, as GRPO's
    validation does."""
    from omegaconf import OmegaConf

    from rl_algorithms import eval as rl_eval
    from rl_algorithms.config import recipe_path
    from rl_distributed.config import load_config
    from rl_models.modeling.precision import generator_dtype

    main = load_config(recipe_path("grpo_main"))
    assert "dtype" in main.generation  # what eval used to refuse
    recipe = OmegaConf.create(
        {
            "model": main.policy.model,
            "tokenizer": main.tokenizer,
            "generation": main.generation,
            "env": main.env,
            "data": {"dataset": {**main.data.train, "size": 8}},
        }
    )
    path = tmp_path / "eval.yaml"
    OmegaConf.save(recipe, path)
    for dtype, held_in in [("auto", None), ("bfloat16", "bfloat16")]:
        config = cli.build_config(
            cli.load_algorithm("eval"), ["--config", str(path), f"generation.dtype={dtype}"]
        )
        assert set(main.generation) <= set(config.generation.model_fields_set)
        plan = rl_eval.generator_plan(config)
        if held_in is None:  # bfloat16 where this machine computes it natively
            held_in = generator_dtype("auto", use_gpus=False) or "float32"
        assert plan.model.dtype == held_in
        assert "dtype" not in plan.config.model_dump()  # the engine's config has no such key
