"""A colocated critic (PPO) or teacher (distillation) that leaves the device between its turns:
the calls a step makes on every model, in order, and that offloading changes no number.

The models are tiny Llamas in real policy workers, run in this process: the controller-side
``Policy`` drives each through ``in_process.InProcessGroup``, a worker group of one in-process
worker, which logs every worker method it runs. The offload target is a dedicated copy in
host memory, as in rl-models' test_offload.py.
"""

from __future__ import annotations

import pytest
import torch

from rl_algorithms import distill, ppo
from rl_algorithms.distill.loop import distill_step
from rl_algorithms.ppo.loop import ppo_step
from rl_algorithms.run import Run, save_checkpoint
from rl_algorithms.utils.checkpoint import CheckpointingConfig, CheckpointManager
from rl_algorithms.utils.logger import Logger, LoggerConfig
from rl_data.collate import rl_collate
from rl_data.loader import StatefulDataLoader
from rl_envs.sliding_puzzle import SlidingPuzzleEnvironment
from rl_models.policy.lm_policy import Policy

from .conftest import TINY_LLAMA
from .in_process import in_process_policy
from .test_grpo_steps import SCRIPT, CyclingGeneration
from .test_rollouts import puzzle_datums

TINY = {**TINY_LLAMA, "vocab_size": 512}  # the test tokenizer has 400 tokens
STEPS = 2
OFFLOAD_CALLS = ["offload_weights", "offload_optimizer_state"]


class LoggedGeneration(CyclingGeneration):
    def __init__(self, tokenizer, log):
        super().__init__(tokenizer, SCRIPT)
        self.log = log

    def generate(self, data, greedy=False, *, expected_weight_version=None):
        self.log.append(("generation", "generate"))
        return super().generate(data, greedy, expected_weight_version=expected_weight_version)


def base_config(tmp_path) -> dict:
    return {
        "policy": {
            "model": {"hf_config": TINY, "dtype": "float32"},
            "train_global_batch_size": 4,
            "train_micro_batch_size": 2,
            "max_total_sequence_length": 512,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 1.0e-2}},
        },
        "tokenizer": {"path": str(tmp_path)},
        "generation": {"backend": "hf"},
        "env": {"puzzle": {"kind": "sliding_puzzle"}},
        "data": {"train": {"source": "arithmetic"}},
        "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
    }


def make_run(config, tokenizer, template, tmp_path, log) -> Run:
    """A run of ``STEPS`` steps of 4 puzzle prompts, its policy in this process."""
    datums = puzzle_datums(tokenizer, template, samples=(0, 1, 2, 0) * STEPS)
    loader = StatefulDataLoader(
        datums, 4, lambda b: rl_collate(b, tokenizer.pad_token_id), shuffle=False
    )
    return Run(
        name="offload",
        config=config,
        policy=in_process_policy(config.policy.worker_config(), "policy", log),
        generation=LoggedGeneration(tokenizer, log),
        clusters=[],
        envs={"puzzle": SlidingPuzzleEnvironment()},
        tokenizer=tokenizer,
        template=template,
        train_loader=loader,
        val_loader=None,
        logger=Logger(LoggerConfig(log_dir=str(tmp_path / "logs"), progress_bar=False)),
        checkpointer=None,
        total_steps=STEPS,
    )


def run_steps(run: Run, step) -> list[dict[str, float]]:
    metrics = []
    for _ in range(STEPS):
        run.generation.weight_version = run.policy.weight_version  # stands in for a refit
        metrics.append(step(run))
        run.step += 1
    return metrics


def weights(model: Policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.worker_group.worker.model.state_dict().items()}


def assert_away_from_the_others(log: list, name: str) -> list[str]:
    """Every call on another model (generation included) came while ``name`` was offloaded;
    returns ``name``'s calls in order."""
    away = False
    for model, method in log:
        if model == name and method == OFFLOAD_CALLS[-1]:
            away = True
        elif model == name and method.startswith("prepare_for"):
            away = False
        elif model != name:
            assert away, f"{model}.{method} ran while the {name} was on the device"
    return [method for model, method in log if model == name]


def ppo_run(tmp_path, tokenizer, template, when_idle: bool):
    config = base_config(tmp_path)
    config["policy"]["reference_policy"] = {"enabled": True}
    config |= {
        "critic": {
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 1.0e-2}},
            "offload": {"when_idle": when_idle, "device": "cpu"},
        },
        # The KL in the rewards: the policy's and the reference's log-probs are taken too.
        "loss_fn": {"reference_policy_kl_penalty": 0.05, "use_kl_in_reward": True},
        "ppo": {"num_prompts_per_step": 4, "max_num_steps": STEPS},
    }
    config = ppo.MasterConfig.model_validate(config)
    log: list = []
    run = make_run(config, tokenizer, template, tmp_path, log)
    run.critic = in_process_policy(config.critic.worker_config(), "critic", log)
    run.loss_fn = ppo.loop.make_loss(config)
    if config.critic.offload.when_idle:
        run.take_turns(run.critic)  # what setup_run does for a ModelPlan that offloads
    return run, log


def test_a_colocated_critic_is_offloaded_whenever_another_model_runs(tmp_path, tokenizer, template):
    run, log = ppo_run(tmp_path, tokenizer, template, when_idle=True)
    on = run_steps(run, ppo_step)
    critic_calls = assert_away_from_the_others(log, "critic")
    turn = ["prepare_for_lp_inference", "get_values", "prepare_for_training", "train"]
    assert critic_calls == OFFLOAD_CALLS + (turn + OFFLOAD_CALLS) * STEPS
    # Every phase that does not use the critic ran (and, above, ran with the critic away).
    others = {entry for entry in log if entry[0] != "critic"}
    assert {("generation", "generate"), ("policy", "get_logprobs"), ("policy", "train")} <= others

    # A checkpoint gathers the critic's state on its device: back for the save, away after.
    run.checkpointer = CheckpointManager(
        CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), save_period=1)
    )
    del log[:]
    save_checkpoint(run, {})
    assert [m for name, m in log if name == "critic"] == [
        "prepare_for_training",
        "save_checkpoint",
        *OFFLOAD_CALLS,
    ]
    assert (tmp_path / "ckpt" / f"step_{STEPS}" / "critic" / "model.safetensors").is_file()

    # The same steps with the critic resident: the same numbers, bit for bit.
    resident, resident_log = ppo_run(tmp_path / "resident", tokenizer, template, when_idle=False)
    off = run_steps(resident, ppo_step)
    assert not {m for name, m in resident_log if name == "critic"} & set(OFFLOAD_CALLS)
    assert on == off
    assert all(torch.isfinite(torch.tensor(m["critic/value_loss"])) for m in on)
    for model in ("policy", "critic"):
        got, want = weights(getattr(run, model)), weights(getattr(resident, model))
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (model, key)


def distill_run(tmp_path, tokenizer, template, when_idle: bool):
    config = distill.MasterConfig.model_validate(
        {
            **base_config(tmp_path),
            "teacher": {
                "model": {"hf_config": TINY, "dtype": "float32"},
                "seed": 7,  # not the student's weights
                "offload": {"when_idle": when_idle, "device": "cpu"},
            },
            "loss_fn": {"estimator": "topk", "kl_type": "mixed"},
            "distillation": {
                "num_prompts_per_step": 4,
                "max_num_steps": STEPS,
                "topk_logits_k": 8,
            },
        }
    )
    log: list = []
    run = make_run(config, tokenizer, template, tmp_path, log)
    run.teacher = in_process_policy(config.teacher.worker_config(), "teacher", log)
    run.loss_fn = distill.loop.make_loss(config)
    if config.teacher.offload.when_idle:
        run.take_turns(run.teacher)
    return run, log


def test_a_colocated_teacher_is_offloaded_once_it_has_scored(tmp_path, tokenizer, template):
    run, log = distill_run(tmp_path, tokenizer, template, when_idle=True)
    on = run_steps(run, distill_step)
    teacher_calls = assert_away_from_the_others(log, "teacher")
    turn = ["prepare_for_lp_inference", "get_topk_logprobs"]
    assert teacher_calls == OFFLOAD_CALLS + (turn + OFFLOAD_CALLS) * STEPS
    assert {("generation", "generate"), ("policy", "train")} <= set(log)

    resident, _ = distill_run(tmp_path / "resident", tokenizer, template, when_idle=False)
    off = run_steps(resident, distill_step)
    assert on == off
    got, want = weights(run.policy), weights(resident.policy)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize(
    ("colocated", "gpus", "given", "resolved"),
    [
        (True, 1, "auto", True),  # shares the policy's GPU: leaves it between turns
        (True, 0, "auto", False),  # on CPUs the "device" is host memory already
        (False, 1, "auto", False),  # workers of its own: nothing to share
        (True, 0, True, True),  # asked for on CPUs: done (a copy in host memory)
        (True, 1, False, False),
    ],
)
def test_when_idle_auto_is_on_for_colocated_models_on_gpus(
    tmp_path, colocated, gpus, given, resolved
):
    config = ppo.MasterConfig.model_validate(
        {
            **base_config(tmp_path),
            "critic": {"colocated": colocated, "offload": {"when_idle": given}},
            "ppo": {"num_prompts_per_step": 4, "max_num_steps": 1},
            "cluster": {"gpus_per_node": gpus},
        }
    )
    assert config.critic.offload.when_idle is resolved
    assert "when_idle" not in config.critic.worker_config().offload.model_dump()


@pytest.mark.parametrize("section", ["critic", "teacher"])
def test_when_idle_true_for_a_model_with_workers_of_its_own_is_refused(tmp_path, section):
    config = base_config(tmp_path)
    offload = {"colocated": False, "offload": {"when_idle": True}}
    if section == "critic":
        config |= {"critic": offload, "ppo": {"num_prompts_per_step": 4, "max_num_steps": 1}}
        master = ppo.MasterConfig
    else:
        teacher = {"model": {"hf_config": TINY}, **offload}
        config |= {
            "teacher": teacher,
            "distillation": {"num_prompts_per_step": 4, "max_num_steps": 1},
        }
        master = distill.MasterConfig
    with pytest.raises(
        ValueError, match=rf"{section}\.offload\.when_idle: true needs {section}\.colocated: true"
    ):
        master.model_validate(config)
