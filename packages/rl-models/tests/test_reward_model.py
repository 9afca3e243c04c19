"""A sequence classifier (reward model) behind the same worker: scores, training, checkpoints."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import TINY_LLAMA, initial_model, skewed_batch, tiny_config

RM_MODEL = {"hf_config": TINY_LLAMA, "dtype": "float64", "kind": "sequence_classification"}


def rm_config(num_labels: int = 1, **overrides) -> PolicyConfig:
    return tiny_config(model={**RM_MODEL, "num_labels": num_labels}, **overrides)


def reference_scores(data, num_labels: int = 1) -> torch.Tensor:
    """Plain HF, each sequence alone and unpadded: its logits at the last token."""
    model = initial_model(kind="sequence_classification", num_labels=num_labels)
    return scores_of(model.eval(), data)


def scores_of(model: torch.nn.Module, data) -> torch.Tensor:
    """``model``'s logits at each sequence's last token, each sequence run alone, unpadded."""
    with torch.no_grad():
        pairs = zip(data["input_ids"], data["input_lengths"], strict=True)
        rows = [model(ids[None, :n]).logits[0] for ids, n in pairs]
    return torch.stack(rows)


def test_a_reward_model_built_from_a_causal_lm_keeps_its_backbone_and_draws_its_head(
    tiny_llama, tmp_path
):
    """Its head comes from the seed, whatever state torch's global generator is in; a reward
    model's own checkpoint brings its head, which is loaded, not drawn again."""
    from transformers import AutoModelForCausalLM

    from rl_models.modeling.build import build_model, new_head_weights
    from rl_models.modeling.config import ModelConfig

    from_lm = ModelConfig(path=tiny_llama, kind="sequence_classification", dtype="float64")
    torch.manual_seed(1)
    rm = build_model(from_lm, seed=5)
    lm = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64)
    backbone = rm.model.state_dict()
    for name, tensor in lm.model.state_dict().items():
        torch.testing.assert_close(backbone[name], tensor, rtol=0, atol=0, msg=name)
    head = rm.score.weight
    assert head.shape == (1, TINY_LLAMA["hidden_size"]) and head.abs().sum() > 0
    torch.manual_seed(2)
    assert torch.equal(build_model(from_lm, seed=5).score.weight, head)
    assert not torch.equal(build_model(from_lm, seed=6).score.weight, head)
    rm.save_pretrained(tmp_path)
    saved = ModelConfig(path=str(tmp_path), kind="sequence_classification", dtype="float64")
    assert torch.equal(build_model(saved, seed=6).score.weight, head)
    # Only the causal LM's files lack the head: a reward model's own load as they are.
    assert new_head_weights(from_lm) == ("score.",) and new_head_weights(saved) == ()


def test_a_head_under_another_name_is_named_when_a_new_one_is_drawn(tiny_llama, tmp_path, caplog):
    """Files whose head is stored under a name the model does not use (a value head saved as
    ``v_head.weight``) get a head drawn from the seed, with a warning naming what was left."""
    from safetensors.torch import load_file, save_file

    from rl_models.modeling.build import build_model
    from rl_models.modeling.config import ModelConfig

    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((Path(tiny_llama) / name).read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    weights["v_head.weight"] = torch.ones(1, TINY_LLAMA["hidden_size"], dtype=torch.float64)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="rl_models.modeling.build"):
        build_model(ModelConfig(path=str(tmp_path), kind="sequence_classification"), seed=5)
    assert "['score.weight']" in caplog.text and "['v_head.weight'] are not loaded" in caplog.text


def test_lora_is_refused_for_a_reward_model():
    with pytest.raises(ValueError, match=r"lora\.enabled works with model\.kind=causal_lm only"):
        rm_config(lora={"enabled": True})


class PairwiseMarginLoss:
    """Squared error of each score against a per-sample target, a mean over global samples."""

    def __call__(self, scores, data, global_valid_seqs, global_valid_toks):
        err = (scores[:, 0] - data.extras["target"].to(scores)) ** 2 * data.sample_mask.to(scores)
        return err.sum() / global_valid_seqs.to(scores), {}


def rm_batch():
    data = skewed_batch()
    data["extras.target"] = torch.linspace(-1.0, 1.0, data.size, dtype=torch.float64)
    return data


@pytest.mark.parametrize(
    "batching",
    [
        {"logprob_micro_batch_size": 3},
        {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 70}},
        {"dynamic_batching": {"enabled": True, "train_mb_tokens": 80}},
    ],
    ids=["microbatches", "packed", "dynamic"],
)
def test_scores_match_the_model_run_on_each_sequence_alone(batching):
    data = skewed_batch()
    worker = DTensorPolicyWorker(rm_config(num_labels=2, **batching))
    got = worker.get_scores(data)["scores"]
    assert got.shape == (data.size, 2)
    torch.testing.assert_close(got, reference_scores(data, num_labels=2), rtol=0, atol=1e-10)


def test_a_reward_model_has_no_logprobs():
    with pytest.raises(ValueError, match="sequence_classification model has no logprobs"):
        DTensorPolicyWorker(rm_config()).get_logprobs(skewed_batch())


def test_a_reward_model_trains_only_on_losses_of_scores():
    from rl_models.losses import NLLLoss

    with pytest.raises(ValueError, match=r"input_type Scores, not NLLLoss \(LossTokenLogprobs\)"):
        DTensorPolicyWorker(rm_config()).train(rm_batch(), NLLLoss())


def test_reward_model_gradient_does_not_depend_on_the_split(tmp_path):
    one = DTensorPolicyWorker(rm_config(train_micro_batch_size=8))
    one.train(rm_batch(), PairwiseMarginLoss())
    many = DTensorPolicyWorker(
        rm_config(sequence_packing={"enabled": True, "max_tokens_per_microbatch": 64})
    )
    many.train(rm_batch(), PairwiseMarginLoss())
    a, b = one.model.state_dict(), many.model.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-10
    initial = DTensorPolicyWorker(rm_config()).model.state_dict()
    assert max(float((a[k] - initial[k]).abs().max()) for k in a) > 1e-3

    many.save_checkpoint(str(tmp_path))
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float64)
    data = skewed_batch()
    with torch.no_grad():
        n = int(data["input_lengths"][1])
        expected = loaded(data["input_ids"][1:2, :n]).logits[0]
    torch.testing.assert_close(many.get_scores(data)["scores"][1], expected, rtol=0, atol=1e-10)
