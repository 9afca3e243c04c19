"""Evaluation: pass@k and majority-vote accuracy of a model on a dataset.

    rl eval --config examples/configs/eval_cpu.yaml checkpoint=results/sft/checkpoints

Each prompt is answered ``eval.num_tests_per_prompt`` (n) times by the generator; the
environment of its task scores every answer (rollouts as in GRPO, possibly multi-turn, or
played by an agent program of your own, ``eval.agent_program``, as ``grpo.agent_program`` plays
GRPO's). A sample is correct when its reward reaches ``eval.success_threshold``. Per prompt with c correct
of n, pass@k is the unbiased estimate ``1 - C(n-c, k) / C(n, k)`` (``rl_envs.metrics``), averaged
over prompts. Majority vote takes, per prompt, the answer the environment extracted most often
(ties: the one seen first) and counts the prompt correct when that answer was scored correct.

The model is ``model`` (a model directory or a config to build), or, with ``checkpoint``, the
policy weights of a checkpoint: a ``step_<n>`` directory, or a checkpoint directory (its latest).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from rl_algorithms.agent_programs.config import AgentProgramConfig
from rl_algorithms.config import ClusterConfig, TokenizerConfig, recipe_path
from rl_algorithms.environments import EnvSection
from rl_algorithms.grpo.config import GRPOGenerationConfig
from rl_algorithms.run import DataPlan, GeneratorPlan, Run, setup_run
from rl_algorithms.utils.logger import LoggerConfig
from rl_data.datasets import DatasetConfig
from rl_distributed.config import ConfigModel
from rl_models.modeling.config import ModelConfig

DEFAULT_RECIPE = recipe_path("eval")


class EvalConfig(ConfigModel):
    """What is measured (NeMo RL's ``eval.*`` keys where it has them)."""

    num_tests_per_prompt: int = Field(8, ge=1)  # n samples per prompt
    pass_k_value: list[int] = Field(default_factory=lambda: [1])  # the k of pass@k (each <= n)
    max_num_prompts: int | None = Field(None, ge=1)  # None: the whole dataset
    prompts_per_batch: int = Field(8, ge=1)  # prompts per generate call (x n rows)
    # Turns per rollout (more for multi-turn environments).
    max_rollout_turns: int = Field(1, ge=1)
    # Each sample played by an agent program of your own through an OpenAI-compatible
    # endpoint (the keys of grpo.agent_program); null: the agent loop.
    agent_program: AgentProgramConfig | None = None
    max_total_sequence_length: int = Field(2048, ge=2)  # prompt + all turns
    success_threshold: float = 1.0  # reward >= this: correct
    # Greedy decoding instead of sampling.
    greedy: bool = False
    # Seeds the sampler and the prompt order.
    seed: int = 42
    output_file: str | None = None  # per-sample JSONL (prompt, response, reward, answer)

    @field_validator("pass_k_value", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) else value

    @field_validator("pass_k_value")
    @classmethod
    def _k_within_n(cls, value: list[int], info: ValidationInfo) -> list[int]:
        n = info.data.get("num_tests_per_prompt")
        bad = [k for k in value if n is not None and not 1 <= k <= n]
        if bad:
            raise ValueError(f"each k must lie in [1, num_tests_per_prompt={n}]; got {bad}")
        return value


class EvalDataConfig(ConfigModel):
    # The dataset evaluated, one of the sources below (chosen by source).
    dataset: DatasetConfig
    max_seq_length: int | None = Field(None, ge=1)  # longer prompts are cut


class MasterConfig(ConfigModel):
    model: ModelConfig | None = None
    checkpoint: str | None = None  # a step_<n> directory or a checkpoint directory (latest)
    tokenizer: TokenizerConfig
    # The generation section of the training recipes (``dtype``, ``num_workers`` included):
    # a recipe's section evaluates its model as its validation samples from it.
    generation: GRPOGenerationConfig = Field(default_factory=GRPOGenerationConfig)
    # One environment per task name: env.<task>.kind (a built-in kind, default the task name, or
    # module:Class) and env.<task>.config.
    env: EnvSection
    data: EvalDataConfig
    eval: EvalConfig = Field(default_factory=EvalConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)

    @model_validator(mode="after")
    def _one_model(self) -> MasterConfig:
        if (self.model is None) == (self.checkpoint is None):
            raise ValueError("give exactly one of model (path or hf_config) and checkpoint")
        if not self.env:
            raise ValueError("env: configure at least one environment (task_name: {kind: ...})")
        if self.generation.tokenizer is None:
            self.generation.tokenizer = self.tokenizer.path  # stop tokens and padding
        return self


def model_to_evaluate(config: MasterConfig) -> ModelConfig:
    """``model``, or the policy weights of ``checkpoint`` (its latest step when it is a
    checkpoint directory)."""
    if config.model is not None:
        return config.model
    from rl_algorithms.utils.checkpoint import (
        POLICY_DIR,
        CheckpointingConfig,
        CheckpointManager,
    )

    path = Path(config.checkpoint or "")
    if not (path / POLICY_DIR).is_dir():
        manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(path), enabled=False))
        latest = manager.latest()
        if latest is None:
            raise FileNotFoundError(f"checkpoint {path}: no complete checkpoint found there")
        path = latest
    return ModelConfig(path=str((path / POLICY_DIR).resolve()))


def generator_plan(config: MasterConfig) -> GeneratorPlan:
    """The generator sampling from the model evaluated, seeded by ``eval.seed``."""
    generation = config.generation.model_copy(update={"seed": config.eval.seed})
    return generation.plan(model_to_evaluate(config), config.cluster.use_gpus)


# -- the metrics ---------------------------------------------------------------------------------


@dataclass
class PromptOutcome:
    """The n samples of one prompt: which were correct, and the answers extracted."""

    correct: list[bool]
    answers: list[str | None]


def majority_vote_correct(outcome: PromptOutcome) -> bool:
    """Whether the most frequent extracted answer (ties: first seen) was scored correct."""
    votes = Counter(a.strip() for a in outcome.answers if a is not None and a.strip())
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a.strip() for a in outcome.answers if a and votes.get(a.strip()) == top)
    return any(
        ok
        for ok, a in zip(outcome.correct, outcome.answers, strict=True)
        if a and a.strip() == winner
    )


def summarize(outcomes: Sequence[PromptOutcome], ks: Sequence[int]) -> dict[str, float]:
    """pass@k for each k, majority-vote accuracy and the mean sample accuracy."""
    from rl_envs.metrics import pass_at_k

    if not outcomes:
        raise ValueError("no prompts were evaluated")
    metrics = {}
    for k in ks:
        values = [pass_at_k(len(o.correct), sum(o.correct), k) for o in outcomes]
        metrics[f"pass@{k}"] = sum(values) / len(values)
    metrics["majority_vote_accuracy"] = sum(map(majority_vote_correct, outcomes)) / len(outcomes)
    samples = [ok for o in outcomes for ok in o.correct]
    metrics["sample_accuracy"] = sum(samples) / len(samples)
    metrics["num_prompts"] = float(len(outcomes))
    metrics["num_samples"] = float(len(samples))
    return metrics


# -- the run -------------------------------------------------------------------------------------


def setup(config: MasterConfig) -> Run:
    """Prompts, cluster, generator (with the model or checkpoint) and environments."""
    from rl_data.collate import rl_collate
    from rl_data.datasets import load_dataset

    cfg = config.eval
    rows = load_dataset(config.data.dataset)
    if cfg.max_num_prompts is not None and cfg.max_num_prompts < len(rows):
        rows = rows.select(range(cfg.max_num_prompts))
    data = DataPlan(
        "prompt",
        rl_collate,
        batch_size=cfg.prompts_per_batch,
        val_batch_size=cfg.prompts_per_batch,
        shuffle=False,
        drop_last=False,
    )
    return setup_run(
        config,
        name="eval",
        seed=cfg.seed,
        data=data,
        generator=generator_plan(config),
        envs=config.env,
        splits={"train": rows},
    )


def evaluate(run: Run) -> dict[str, float]:
    """Sample, score and summarise every prompt; logs ``eval/*`` at step 0."""
    from rl_algorithms.agent_programs.programs import program_metrics, rollout_through_programs
    from rl_algorithms.rollouts import run_rollouts

    cfg = run.config.eval
    n = cfg.num_tests_per_prompt
    outcomes: list[PromptOutcome] = []
    records: list[dict[str, Any]] = []
    end_reasons: list[str] = []  # each episode's, and its requests: what agent programs did
    requests: list[int] = []
    run.logger.progress.start(len(run.train_loader), description="eval")
    for batch_number, prompts in enumerate(run.train_loader, start=1):
        with run.logger.timer("generation"):
            run.generation.prepare_for_generation()
            try:
                if cfg.agent_program is not None:
                    result = rollout_through_programs(
                        run,
                        cfg.agent_program,
                        prompts.repeat_interleave(n),
                        max_seq_len=cfg.max_total_sequence_length,
                        greedy=cfg.greedy,
                    )
                else:
                    result = run_rollouts(
                        run.generation,
                        prompts.repeat_interleave(n),
                        run.tokenizer,
                        run.template,
                        run.envs,
                        max_seq_len=cfg.max_total_sequence_length,
                        max_turns=cfg.max_rollout_turns,
                        greedy=cfg.greedy,
                    )
            finally:
                run.generation.finish_generation()
        # A sample that carries no score (its program failed, its environment did not
        # answer) is wrong whatever success_threshold is.
        scored = result.sample_mask() > 0
        correct = ((result.rewards >= cfg.success_threshold) & scored).tolist()
        end_reasons += result.end_reasons
        requests += result.turns.tolist()
        for p in range(prompts.size):
            rows = range(p * n, (p + 1) * n)
            outcomes.append(
                PromptOutcome([correct[r] for r in rows], [result.answers[r] for r in rows])
            )
            if cfg.output_file is not None:
                records += [
                    {
                        "prompt_idx": int(prompts["idx"][p]),
                        "sample": r - p * n,
                        "response": _response_text(
                            result.message_logs[r], len(prompts["message_log"][p])
                        ),
                        "reward": float(result.rewards[r]),
                        "correct": correct[r],
                        "answer": result.answers[r],
                    }
                    for r in rows
                ]
        run.logger.progress.update(batch_number, {})
    run.logger.progress.stop()
    metrics = {**summarize(outcomes, cfg.pass_k_value), **run.logger.timer.pop()}
    if cfg.agent_program is not None:
        metrics.update(program_metrics(end_reasons, requests))
    run.logger.log_metrics(metrics, step=0, prefix="eval")
    if cfg.output_file is not None:
        path = Path(cfg.output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return metrics


def _response_text(log: list[dict[str, Any]], prompt_messages: int) -> str:
    return "".join(m.get("content", "") for m in log[prompt_messages:])


COUNTS = ("num_prompts", "num_samples")


def print_report(metrics: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rl eval")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        if not key.startswith("timing/"):
            table.add_row(
                key, f"{value:.0f}" if key in COUNTS or "/failed" in key else f"{value:.4f}"
            )
    Console().print(table)


def main(config: MasterConfig) -> dict[str, float]:
    run = setup(config)
    try:
        metrics = evaluate(run)
    finally:
        run.shutdown()
    print_report(metrics)
    return metrics
