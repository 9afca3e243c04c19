"""NeMo RL's own recipes (verbatim copies in nemo_recipes/), translated and validated key by key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rl_algorithms import cli
from rl_algorithms.nemo_compat import translate, translate_file
from rl_algorithms.nemo_compat.convert import main as convert_main
from rl_algorithms.nemo_compat.core import flatten
from rl_data.datasets.base import deferred_path_checks
from rl_distributed.config import load_config

RECIPES = Path(__file__).parent / "nemo_recipes"
ALGORITHM = {
    "grpo_math_1B": "grpo",
    "grpo_math_1B_megatron": "grpo",
    "dpo": "dpo",
    "sft": "sft",
    "grpo_sliding_puzzle": "grpo",
}
# The sliding-puzzle recipe offloads FSDP2 parameters to the CPU, which is refused here.
NO_OFFLOAD = {"grpo_sliding_puzzle": ["policy.dtensor_cfg.cpu_offload=false"]}


def recipe(name: str) -> str:
    return str(RECIPES / f"{name}.yaml")


def validated(name: str, *overrides: str) -> dict:
    algorithm = cli.load_algorithm(ALGORITHM[name])
    argv = ["--config", recipe(name), *NO_OFFLOAD.get(name, []), *overrides]
    return algorithm.MasterConfig.model_dump(cli.build_config(algorithm, argv))


def select(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


COMMON_GRPO = {
    "grpo.num_prompts_per_step": 32,
    "grpo.num_generations_per_prompt": 16,
    "grpo.max_num_epochs": 1,
    "grpo.normalize_rewards": True,
    "grpo.use_leave_one_out_baseline": True,
    "grpo.val_period": 10,
    "grpo.val_at_start": False,
    "grpo.max_val_samples": 256,
    "grpo.val_batch_size": 256,
    "grpo.seed": 42,
    "grpo.advantage_estimator": "grpo",
    "grpo.async_grpo.enabled": False,
    "grpo.async_grpo.max_trajectory_age_steps": 1,
    "loss_fn.reference_policy_kl_penalty": 0.01,
    "loss_fn.reference_policy_kl_type": "k3",
    "loss_fn.ratio_clip_min": 0.2,
    "loss_fn.ratio_clip_max": 0.2,
    "loss_fn.ratio_clip_c": None,
    "loss_fn.token_level_loss": True,
    "checkpointing.metric_name": "val/accuracy",
    "checkpointing.keep_top_k": 3,
    "policy.train_micro_batch_size": 4,
    "policy.logprob_micro_batch_size": 4,
    "policy.max_grad_norm": 1.0,
    "policy.sequence_packing.enabled": True,
    "policy.sequence_packing.algorithm": "modified_first_fit_decreasing",
    "policy.dynamic_batching.enabled": False,
    "generation.backend": "vllm",
    "generation.colocated": True,
    "generation.vllm.gpu_memory_utilization": 0.6,
    "cluster.gpus_per_node": 1,
    "cluster.num_nodes": 1,
    "logger.log_dir": "logs",
    "logger.wandb_enabled": False,
    "logger.tensorboard_enabled": False,
}

EXPECTED = {
    "grpo_math_1B": {
        **COMMON_GRPO,
        "grpo.max_num_steps": 1000000,
        "grpo.max_rollout_turns": 1,
        "grpo.val_at_end": False,
        "policy.model.path": "Qwen/Qwen2.5-1.5B",
        "tokenizer.path": "Qwen/Qwen2.5-1.5B",
        "policy.backend": "dtensor",
        "policy.model.dtype": "float32",
        "policy.mixed_precision": "bfloat16",
        "policy.dtensor.tensor_parallel_size": 1,
        "policy.dtensor.sequence_parallel": False,
        "policy.dtensor.context_parallel_size": 1,
        "policy.train_global_batch_size": 512,
        "policy.max_total_sequence_length": 512,
        "policy.sequence_packing.max_tokens_per_microbatch": 2048,
        "policy.optimizer.name": "AdamW",
        "policy.optimizer.kwargs": {
            "lr": 5.0e-6,
            "weight_decay": 0.01,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
        },
        "policy.scheduler.name": "LinearLR",
        "policy.scheduler.kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": 50},
        "generation.sampling.temperature": 1.0,
        "generation.sampling.top_p": 1.0,
        "generation.sampling.top_k": None,
        "generation.sampling.max_new_tokens": 512,
        "generation.sampling.stop_strings": [],
        "generation.vllm.max_model_len": 512,
        "generation.vllm.enforce_eager": False,
        "generation.vllm.dtype": "bfloat16",
        "env.math.kind": "math",
        "env.math.config.num_workers": 8,
        "data.validation_fraction": 0.05,
        "data.seed": 42,
        "data.max_seq_length": 512,
        "data.train.source": "chat_file",
        "data.train.env_info_keys": ["ground_truth"],
        "data.train.task_name": "math",
        "checkpointing.checkpoint_dir": "results/grpo",
    },
    "grpo_math_1B_megatron": {
        **COMMON_GRPO,
        "grpo.max_num_steps": 1000000,
        "policy.backend": "megatron",
        "policy.model.dtype": "float32",
        "policy.mixed_precision": None,
        "policy.megatron.tensor_parallel_size": 1,
        "policy.megatron.pipeline_parallel_size": 1,
        "policy.megatron.sequence_parallel": False,
        "policy.megatron.expert_parallel_size": 1,
        "policy.optimizer.name": "AdamW",
        "policy.optimizer.kwargs": {
            "lr": 5.0e-6,
            "weight_decay": 0.01,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
        },
        # Megatron's warm-up from lr_warmup_init=5e-7 to lr=5e-6 over 13 steps, then constant.
        "policy.scheduler.name": "LinearLR",
        "policy.scheduler.kwargs": {"start_factor": 0.1, "total_iters": 13},
        "checkpointing.enabled": False,
        "checkpointing.checkpoint_dir": "results/grpo_megatron",
        "logger.monitor_gpus": False,
    },
    "dpo": {
        "dpo.max_num_steps": 150,
        "dpo.val_period": 25,
        "dpo.val_batches": 8,
        "dpo.val_global_batch_size": 8,
        "dpo.val_micro_batch_size": 1,
        "dpo.val_at_start": True,
        "dpo.val_at_end": False,
        "dpo.reference_policy_kl_penalty": 0.05,
        "dpo.preference_average_log_probs": False,
        "dpo.sft_average_log_probs": False,
        "dpo.preference_loss_weight": 1.0,
        "dpo.sft_loss_weight": 0.0,
        "policy.model.path": "meta-llama/Llama-3.2-1B-Instruct",
        "tokenizer.path": "meta-llama/Llama-3.2-1B-Instruct",
        "policy.train_global_batch_size": 128,
        "policy.train_micro_batch_size": 2,
        "policy.mixed_precision": "bfloat16",
        "policy.optimizer.kwargs": {
            "lr": 5.0e-6,
            "weight_decay": 0.1,
            "betas": [0.9, 0.98],
            "eps": 1e-5,
            "foreach": False,
            "fused": False,
        },
        "policy.scheduler.kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": 20},
        "data.max_seq_length": 1024,
        "data.train.source": "preference_file",
        "data.validation.source": "preference_file",
        "checkpointing.metric_name": "val/loss",
        "checkpointing.higher_is_better": False,
        "checkpointing.save_period": 50,
        "logger.tensorboard.log_dir": "tb_logs-dpo-dev",
    },
    "sft": {
        "sft.max_num_steps": 60,
        "sft.val_global_batch_size": 32,
        "sft.val_batches": 8,
        "sft.val_at_start": True,
        "sft.val_at_end": False,
        "policy.model.path": "meta-llama/Llama-3.2-1B",
        "tokenizer.path": "meta-llama/Llama-3.2-1B",
        "tokenizer.chat_template.kind": "jinja",
        "policy.train_global_batch_size": 32,
        "policy.train_micro_batch_size": 1,
        "policy.optimizer.kwargs.betas": [0.9, 0.98],
        "policy.scheduler": None,
        "data.max_seq_length": 1024,
        "data.train.source": "chat_file",
        "data.validation.source": "chat_file",
        "checkpointing.metric_name": "val/loss",
        "logger.wandb_enabled": True,
        "logger.wandb.project": "sft-dev",
        "logger.wandb.name": "sft-dev-squad",
    },
    "grpo_sliding_puzzle": {
        **COMMON_GRPO,
        "grpo.max_num_steps": 10000,
        "grpo.max_rollout_turns": 50,
        "policy.model.path": "Qwen/Qwen2.5-1.5B-Instruct",
        "tokenizer.path": "Qwen/Qwen2.5-1.5B-Instruct",
        "policy.max_total_sequence_length": 1024,
        "policy.activation_checkpointing": True,
        "generation.sampling.top_p": 0.999,
        "generation.sampling.top_k": 10000,
        "generation.sampling.max_new_tokens": 1024,
        "generation.sampling.stop_strings": ["</action>"],
        "env.sliding_puzzle_game.kind": "sliding_puzzle",
        "env.sliding_puzzle_game.config.max_turns": 30,
        "env": {"sliding_puzzle_game": {"kind": "sliding_puzzle", "config": {"max_turns": 30}}},
        "data.train.source": "chat_file",
        "data.train.prompt_key": "prompt",
        "data.train.env_info_keys": ["board", "turn"],
        "data.train.task_name": "sliding_puzzle_game",
        "data.validation.task_name": "sliding_puzzle_game",
        "data.shuffle": False,
        "checkpointing.checkpoint_dir": "results/grpo-sliding-puzzle",
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_nemo_recipe_validates_with_its_keys_translated(name):
    config = validated(name)
    for key, want in EXPECTED[name].items():
        assert (
            select(config, key) == pytest.approx(want)
            if isinstance(want, float)
            else (select(config, key) == want)
        ), key


def test_val_at_end_is_translated_both_ways_since_our_default_differs_from_nemos():
    # NeMo validates after the last step only when val_at_end is true; ours, left out, does
    # whenever val_period > 0. So false must reach our config too, not be dropped as neutral.
    assert validated("grpo_math_1B")["grpo"]["val_at_end"] is False
    on = validated("grpo_math_1B", "grpo.val_at_end=true", "grpo.val_period=0")
    assert (on["grpo"]["val_at_end"], on["grpo"]["val_period"]) == (True, 0)


def test_a_switched_off_section_of_the_value_model_is_named_as_the_recipe_names_it():
    # ppo_math_1B packs the policy's sequences but not the value model's.
    translation, _ = translate_file(str(RECIPES / "ppo_math_1B.yaml"), [], "ppo")
    reasons = {e.key: e.reason for e in translation.ignored}
    assert reasons["value.sequence_packing.algorithm"] == (
        "section value.sequence_packing is off (value.sequence_packing.enabled: false)"
    )
    assert "policy.sequence_packing.algorithm" not in reasons
    assert "  value.sequence_packing.* (4 keys):" in translation.ignored_report()


@pytest.mark.parametrize("name", sorted(ALGORITHM))
def test_every_key_of_a_recipe_is_translated_ignored_or_refused_once(name):
    translation, _ = translate_file(recipe(name), [], ALGORITHM[name])
    resolved = load_config(recipe(name))
    from omegaconf import OmegaConf

    leaves = [k for k, _ in flatten(OmegaConf.to_container(resolved, resolve=True))]
    seen = [e.key for e in translation.translated + translation.ignored + translation.refused]
    assert sorted(seen) == sorted(leaves)
    assert len(translation.translated) > 50 and len(translation.ignored) > 100
    refused = {e.key for e in translation.refused}
    assert refused == ({"policy.dtensor_cfg.cpu_offload"} if "sliding" in name else set())


def test_dtensor_tensor_and_sequence_parallel_sizes_carry_over():
    config = validated(
        "grpo_math_1B",
        "policy.dtensor_cfg.tensor_parallel_size=2",
        "policy.dtensor_cfg.sequence_parallel=true",
    )
    assert select(config, "policy.dtensor") == {
        "tensor_parallel_size": 2,
        "sequence_parallel": True,
        "context_parallel_size": 1,
    }


def test_dtensor_context_parallel_size_carries_over_with_tensor_parallelism_too():
    config = validated("grpo_math_1B", "policy.dtensor_cfg.context_parallel_size=2")
    assert select(config, "policy.dtensor.context_parallel_size") == 2
    config = validated(
        "grpo_math_1B",
        "policy.dtensor_cfg.context_parallel_size=2",
        "policy.dtensor_cfg.tensor_parallel_size=2",
    )
    assert select(config, "policy.dtensor.context_parallel_size") == 2
    assert select(config, "policy.dtensor.tensor_parallel_size") == 2


@pytest.mark.parametrize(
    "section, key, value, named",
    [
        ("dtensor_cfg", "activation_checkpointing", True, "activation_checkpointing"),
        ("lora_cfg", "enabled", True, "lora.enabled"),
        ("router_replay", "enabled", True, "router_replay"),
        ("reward_model_cfg", "enabled", True, "model.kind=sequence_classification"),
    ],
)
def test_dtensor_context_parallel_is_refused_with_what_our_config_refuses(
    section, key, value, named
):
    """The mapping asks the config's own rule (``context_parallel_clashes``)."""
    tree, algorithm = sft_tree(), "sft"
    policy = tree["policy"]
    policy["dtensor_cfg"]["context_parallel_size"] = 2
    if section == "reward_model_cfg":  # a reward model is trained by `rl rm`
        tree["rm"], algorithm = tree.pop("sft") | {"max_num_steps": -1, "val_batches": -1}, "rm"
        del tree["rm"]["only_unmask_final"]
    parent = policy["dtensor_cfg"] if section == "lora_cfg" else policy
    parent.setdefault(section, {})[key] = value
    refused = {e.key: e.reason for e in translate(tree, algorithm).refused}
    reason = refused["policy.dtensor_cfg.context_parallel_size"]
    assert reason == f"would split sequences across GPUs with {named}"


def test_megatron_expert_parallel_size_carries_over_and_expert_tp_only_when_it_changes_nothing():
    config = validated(
        "grpo_math_1B_megatron",
        "policy.megatron_cfg.expert_model_parallel_size=4",
        "policy.megatron_cfg.tensor_model_parallel_size=2",
        "policy.megatron_cfg.expert_tensor_parallel_size=2",
    )
    assert select(config, "policy.megatron.expert_parallel_size") == 4
    assert select(config, "policy.megatron.tensor_parallel_size") == 2
    tree = yaml.safe_load(Path(recipe("grpo_math_1B_megatron")).read_text())
    megatron = tree["policy"]["megatron_cfg"]
    for etp, tp, refused in [(1, 2, False), (None, 4, False), (4, 4, False), (2, 4, True)]:
        megatron.update(expert_tensor_parallel_size=etp, tensor_model_parallel_size=tp)
        translation = translate(tree, "grpo")
        reasons = {e.key: e.reason for e in translation.refused}
        key = "policy.megatron_cfg.expert_tensor_parallel_size"
        assert (key in reasons) == refused, (etp, tp)
        if refused:
            assert "split MoE experts unlike the dense layers" in reasons[key]


def test_a_refused_key_stops_the_run_with_what_it_would_have_done(capsys):
    assert cli.main(["grpo", "--config", recipe("grpo_sliding_puzzle"), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "policy.dtensor_cfg.cpu_offload" in err
    assert "would keep parameters, gradients and optimizer state in CPU memory" in err


def sft_tree() -> dict:
    return yaml.safe_load(Path(recipe("sft")).read_text())


def validated_tree(tree: dict, tmp_path: Path) -> dict:
    """Our validated config for an SFT NeMo recipe given as data."""
    path = tmp_path / "sft_variant.yaml"
    path.write_text(yaml.safe_dump(tree))
    algorithm = cli.load_algorithm("sft")
    return algorithm.MasterConfig.model_dump(cli.build_config(algorithm, ["--config", str(path)]))


def test_keys_nobody_knows_and_schedulers_torch_lacks_are_refused():
    tree = sft_tree()
    tree["policy"]["dtensor_cfg"]["brand_new_knob"] = 3
    tree["policy"]["scheduler"] = [{"name": "my.pkg.WarmupCosine", "kwargs": {}}]
    refused = {e.key: e.reason for e in translate(tree, "sft").refused}
    assert "not a NeMo RL key" in refused["policy.dtensor_cfg.brand_new_knob"]
    assert "only torch.optim.lr_scheduler classes" in refused["policy.scheduler"]


def test_a_reward_model_recipe_trains_a_bradley_terry_classifier_and_only_in_rl_rm():
    tree = sft_tree()
    tree["rm"] = tree.pop("sft") | {"max_num_steps": -1, "val_batches": -1}
    del tree["rm"]["only_unmask_final"]  # (an SFT key)
    tree["policy"]["reward_model_cfg"] = {"enabled": True, "reward_model_type": "bradley_terry"}
    result = translate(tree, "rm")
    assert not result.refused
    model = result.config["policy"]["model"]
    assert (model["kind"], model["num_labels"]) == ("sequence_classification", 1)
    assert result.config["rm"]["max_num_steps"] is None  # NeMo's -1: the epochs decide
    assert result.config["rm"]["val_batches"] == 0  # NeMo's -1: every batch
    tree["policy"]["reward_model_cfg"]["reward_model_type"] = "regression"
    refused = {e.key: e.reason for e in translate(tree, "rm").refused}
    assert "'regression' reward model" in refused["policy.reward_model_cfg.reward_model_type"]
    tree["sft"] = tree.pop("rm")  # the same policy section in an SFT recipe
    refused = {e.key: e.reason for e in translate(tree, "sft").refused}
    assert "that is `rl rm` here" in refused["policy.reward_model_cfg.enabled"]


def test_gdpos_math_environment_becomes_its_three_reward_functions():
    tree = {"env": {"math_multi_reward": {"num_workers": 2, "math_verify_impl": "hf_math_verify"}}}
    result = translate(tree, "grpo")
    assert not result.refused
    env = result.config["env"]["math_multi_reward"]
    assert env["kind"] == "reward_functions" and env["config"]["num_workers"] == 2
    functions = [(f["function"], f["name"]) for f in env["config"]["functions"]]
    assert functions == [
        ("answer_exact", "correctness"),
        ("think_answer_format", "format"),
        ("answer_is_integer", "integer"),
    ]
    tree["env"]["math_multi_reward"]["math_verify_impl"] = "dapo_math_verify"
    refused = {e.key for e in translate(tree, "grpo").refused}
    assert refused == {"env.math_multi_reward.math_verify_impl"}


def test_scheduler_chains_are_collapsed_only_when_the_warm_up_ends_at_the_full_rate(tmp_path):
    def translated(end_factor: float | None, then: str = "ConstantLR") -> object:
        tree = sft_tree()
        warmup = {"start_factor": 0.1, "total_iters": 5}
        if end_factor is not None:
            warmup["end_factor"] = end_factor
        tree["policy"]["scheduler"] = [
            {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": warmup},
            {"name": f"torch.optim.lr_scheduler.{then}", "kwargs": {"factor": 1.0}},
            {"milestones": [5]},
        ]
        result = translate(tree, "sft")
        assert not result.refused
        return result.config["policy"]["scheduler"]

    assert translated(None) == {
        "name": "LinearLR",
        "kwargs": {"start_factor": 0.1, "total_iters": 5},
    }
    assert translated(1.0)["name"] == "LinearLR"
    # Warm-up to half the rate, then back to the full rate: not one LinearLR.
    assert translated(0.5) == [
        {"name": "LinearLR", "kwargs": {"start_factor": 0.1, "total_iters": 5, "end_factor": 0.5}},
        {"name": "ConstantLR", "kwargs": {"factor": 1.0}},
        {"milestones": [5]},
    ]
    # Our config takes the chain (validated) as NeMo wrote it.
    tree = sft_tree()
    tree["policy"]["scheduler"] = [
        {"name": "LinearLR", "kwargs": {"start_factor": 0.1, "end_factor": 0.5, "total_iters": 5}},
        {"name": "ConstantLR", "kwargs": {"factor": 1.0}},
        {"milestones": [5]},
    ]
    config = validated_tree(tree, tmp_path)
    assert config["policy"]["scheduler"][2] == {"milestones": [5]}


def test_chat_template_follows_nemo_null_default_and_jinja_file(tmp_path):
    def template(value: object, source: str | None = None, **data: bool) -> object:
        tree = sft_tree()
        tree["policy"]["tokenizer"]["chat_template"] = value
        tree["data"].update({"add_bos": False, "add_eos": False, **data})
        result = translate(tree, "sft", source)
        refused = {e.key: e.reason for e in result.refused}
        return refused or result.config["tokenizer"]["chat_template"]

    assert template(None) == {"kind": "passthrough"}
    assert template("default") == {"kind": "tokenizer"}
    (tmp_path / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    recipe_file = str(tmp_path / "recipe.yaml")
    assert template("mine.jinja", recipe_file) == {
        "kind": "jinja",
        "template": "{{ messages[0]['content'] }}",
    }
    missing = template("absent.jinja", recipe_file)
    assert (
        "chat template file 'absent.jinja' not found" in missing["policy.tokenizer.chat_template"]
    )
    # add_bos / add_eos: the template writes the tokens (our tokenizer adds none itself) ...
    assert template(None, add_bos=True, add_eos=True) == {
        "kind": "jinja",
        "template": "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
        "{% endfor %}{{ eos_token }}",
    }
    assert template("{{ bos_token }}x", add_bos=True, add_eos=True)["template"] == (
        "{{ bos_token }}x{{ eos_token }}"
    )
    # ... and cannot where the template is the tokenizer's own, known only at run time.
    refused = template("default", add_eos=True)
    assert "add BOS/EOS around the tokenizer's own template" in refused["data.add_eos"]


def test_the_sft_recipe_template_gets_bos_and_eos_as_nemo_adds_them():
    from rl_data.templates import ChatTemplate, ChatTemplateConfig

    config = validated("sft")
    template = ChatTemplate(config["tokenizer"]["chat_template"]["template"])
    template.special_tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert template.render(messages) == "<s> Question: Q Answer: A</s>"
    assert ChatTemplateConfig.model_validate(config["tokenizer"]["chat_template"]).kind == "jinja"


def test_nemo_optimizer_replaces_ours_whole(tmp_path):
    tree = sft_tree()
    tree["policy"]["optimizer"] = {"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}}
    config = validated_tree(tree, tmp_path)
    assert config["policy"]["optimizer"]["name"] == "SGD"
    assert config["policy"]["optimizer"]["kwargs"] == {"lr": 0.1}  # no weight_decay of ours


def test_overrides_may_name_nemo_keys_or_ours():
    config = validated(
        "grpo_math_1B", "policy.generation.temperature=0.5", "cluster.ray_num_cpus=2"
    )
    assert config["generation"]["sampling"]["temperature"] == 0.5
    assert config["cluster"]["ray_num_cpus"] == 2
    # an override of policy.model_name follows into every key interpolating it
    config = validated("grpo_math_1B", "policy.model_name=org/other")
    assert config["policy"]["model"]["path"] == config["tokenizer"]["path"] == "org/other"


@pytest.mark.parametrize("name", sorted(ALGORITHM))
def test_convert_config_writes_a_native_recipe_giving_the_same_config(name, tmp_path, capsys):
    out = tmp_path / "ours.yaml"
    # A refused key: the file is still written, but the exit status says it is not the same.
    assert convert_main([recipe(name), "-o", str(out)]) == (2 if "sliding" in name else 0)
    if "sliding" in name:
        assert "1 NeMo key(s) refused" in capsys.readouterr().err
    text = out.read_text()
    assert "# from policy.model_name" in text  # every translated key names its source
    assert "# -- NeMo RL keys ignored" in text
    algorithm = cli.load_algorithm(ALGORITHM[name])
    # The converted data files it names exist once the NeMo recipe has run (its header says so).
    with deferred_path_checks():
        native = cli.build_config(algorithm, ["--config", str(out)])
    native = algorithm.MasterConfig.model_dump(native)
    if "sliding" in name:  # the refused key is listed, commented out, and left out
        assert "# policy.dtensor_cfg.cpu_offload: true  -- would keep" in text
    assert native == validated(name)


# -- models and data ------------------------------------------------------------------------------


def test_the_documented_key_table_lists_every_rule():
    from rl_algorithms.nemo_compat.rules import RULES

    doc = (Path(__file__).parents[3] / "docs" / "nemo-rl.md").read_text()
    missing = [pattern for pattern, _ in RULES if f"`{pattern}`" not in doc]
    assert not missing, f"docs/nemo-rl.md lacks rows for {missing}"
