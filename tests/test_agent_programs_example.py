"""The "Train an existing agent program" example of docs/guides/agent-programs.md: the page
shows the agent whole, it is short, and GRPO trains it for two steps on the tiny CPU recipe,
every sampled token it trains on being, byte for byte, a token the endpoint returned."""

import math
import re
from collections import Counter
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "agent_programs" / "calculator_agent.py"
RECIPE = ROOT / "examples" / "agent_programs" / "grpo_calculator_agent.yaml"
RECORDER = Path(__file__).with_name("agent_program_recorder.py")


def test_the_guide_shows_the_agent_whole_and_it_is_short():
    page = (ROOT / "docs" / "guides" / "agent-programs.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert EXAMPLE.read_text() in blocks
    assert len(EXAMPLE.read_text().splitlines()) <= 40


@pytest.mark.slow
def test_grpo_trains_the_agent_on_the_tokens_the_endpoint_returned(tmp_path, monkeypatch):
    from rl_algorithms import cli
    from rl_algorithms.agent_programs import programs
    from rl_algorithms.grpo.loop import grpo_train, setup
    from rl_envs.reward_functions import load_reward_function

    monkeypatch.chdir(ROOT)
    rollouts = []
    original = programs.run_program_rollouts

    def kept(*args, **kwargs):
        rollouts.append(original(*args, **kwargs))
        return rollouts[-1]

    monkeypatch.setattr(programs, "run_program_rollouts", kept)
    config = cli.build_config(
        cli.load_algorithm("grpo"),
        [
            "--config",
            str(RECIPE),
            f"grpo.agent_program.function={RECORDER}:agent",
            f"logger.log_dir={tmp_path / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            "checkpointing.enabled=false",
            "logger.tensorboard_enabled=false",
        ],
    )
    ray_was_running = ray.is_initialized()
    run = setup(config)
    try:
        last = grpo_train(run)
    finally:
        run.shutdown()
        # The run started Ray in this process, sized to this recipe: later tests of the same
        # process (the slow tier runs every package's) must start their own.
        if not ray_was_running:
            ray.shutdown()
    assert run.step == 2 and math.isfinite(last["loss"])
    assert len(rollouts) == 4  # two training steps; validation: 8 prompts, 4 per batch
    replies = load_reward_function(f"{RECORDER}:agent").__globals__["replies"]
    returned = Counter(tuple(r.choices[0].token_ids) for r in replies)
    trained = Counter(
        tuple(m["token_ids"][m["token_loss_mask"].bool()].tolist())
        for result in rollouts
        for log in result.message_logs
        for m in log
        if "token_loss_mask" in m
    )
    assert trained == returned and sum(returned.values()) >= 16 + 8
    assert all(r.metrics["agent_program/failed_episodes"] == 0 for r in rollouts)
