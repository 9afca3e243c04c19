"""A checkpoint belongs to the algorithm (and loss) that wrote it: `rl grpo` pointed at an
`rl sft` run's checkpoint_dir is refused before Ray or any worker starts, instead of resuming
from the SFT step and optimiser and writing its own steps into the SFT run's folder."""

import json

import pytest
import ray
import yaml

from rl_algorithms import actors, cli
from rl_algorithms.run import open_checkpoints
from rl_algorithms.utils.checkpoint import INFO_FILE, RUN_KEYS
from rl_models.losses import NLLLoss

from .conftest import TINY_LLAMA


@pytest.fixture
def shared(tmp_path, tokenizer) -> dict:
    """What an SFT and a GRPO recipe share here: the model, tokenizer and checkpoint_dir."""
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    return {
        "policy": {"model": {"hf_config": TINY_LLAMA, "dtype": "float32"}},
        "tokenizer": {"path": str(tmp_path / "tokenizer")},
        "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
        "checkpointing": {"checkpoint_dir": str(tmp_path / "ckpt")},
    }


def config_of(algorithm: str, recipe: dict, tmp_path) -> object:
    """The validated config `rl <algorithm> --config <recipe>` runs with."""
    path = tmp_path / f"{algorithm}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return cli.build_config(cli.load_algorithm(algorithm), ["--config", str(path)])


def sft_config(tmp_path, shared):
    chats = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "up"}, {"role": "assistant", "content": "x"}]}
    chats.write_text(json.dumps(chat) + "\n")
    data = {"train": {"source": "chat_file", "path": str(chats)}, "max_seq_length": 64}
    return config_of("sft", {**shared, "data": data}, tmp_path)


def grpo_config(tmp_path, shared):
    recipe = {
        **shared,
        "generation": {"backend": "hf"},
        "env": {"arithmetic": {"kind": "math", "config": {"num_workers": 1}}},
        "data": {"train": {"source": "arithmetic", "size": 16}, "max_seq_length": 64},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
        "policy": {
            **shared["policy"],
            "train_global_batch_size": 4,
            "train_micro_batch_size": 2,
        },
        "cluster": {"ray_num_cpus": 2},
    }
    return config_of("grpo", recipe, tmp_path)


def save_as_sft(tmp_path, shared, **manager_options):
    """An SFT run's checkpoint, recorded as `rl sft`'s setup and end of step record it."""
    config = sft_config(tmp_path, shared)
    checkpointer, latest = open_checkpoints(config, "sft", NLLLoss())
    assert latest is None  # a fresh directory: nothing to resume
    for key, value in manager_options.items():
        setattr(checkpointer, key, value)
    return checkpointer.save(3, None, run_config=config.model_dump(mode="json"))


def test_grpo_refuses_an_sft_checkpoint_dir_before_ray_starts(
    tmp_path, shared, monkeypatch, capsys
):
    path = save_as_sft(tmp_path, shared)
    info = json.loads((path / INFO_FILE).read_text())
    assert info["identity"]["algorithm"] == "sft"
    assert info["identity"]["loss"] == "NLLLoss"

    def no_cluster(*args, **kwargs):
        raise AssertionError("the cluster started: the checkpoint was not checked first")

    monkeypatch.setattr(actors, "start_cluster", no_cluster)
    grpo_config(tmp_path, shared)  # writes grpo.yaml
    ray_was_up = ray.is_initialized()  # an earlier test in this process may have started it
    assert cli.main(["grpo", "--config", str(tmp_path / "grpo.yaml")]) == cli.CONFIG_ERROR_EXIT
    ckpt = tmp_path / "ckpt"
    assert capsys.readouterr().err == (
        f"rl grpo: checkpointing.checkpoint_dir '{ckpt}' holds a checkpoint of an `rl sft` run "
        "(step_3), and this is `rl grpo`: use a new checkpoint_dir (to start from that run's "
        f"weights, set policy.model.path to '{ckpt / 'step_3' / 'policy'}')\n"
    )
    assert ray.is_initialized() == ray_was_up
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_3"]  # nothing written into it


def test_the_same_algorithm_resumes_and_another_loss_is_refused(tmp_path, shared):
    save_as_sft(tmp_path, shared)
    config = sft_config(tmp_path, shared)
    _, latest = open_checkpoints(config, "sft", NLLLoss())
    assert latest is not None and latest.name == "step_3"

    class OtherLoss(NLLLoss):
        pass

    with pytest.raises(ValueError, match=r"loss: checkpoint 'NLLLoss', this run '.*OtherLoss'"):
        open_checkpoints(config, "sft", OtherLoss())


def test_a_checkpoint_that_records_no_algorithm_resumes_as_before(tmp_path, shared):
    # Written before the algorithm and loss were recorded: only the config keys are there.
    path = save_as_sft(tmp_path, shared, algorithm=None, loss=None)
    identity = json.loads((path / INFO_FILE).read_text())["identity"]
    assert not set(RUN_KEYS) & set(identity)
    checkpointer, latest = open_checkpoints(sft_config(tmp_path, shared), "sft", NLLLoss())
    assert latest == path
    # Its next checkpoint records both.
    new = checkpointer.save(4, None, run_config=sft_config(tmp_path, shared).model_dump())
    assert json.loads((new / INFO_FILE).read_text())["identity"]["algorithm"] == "sft"
