"""A value model (critic) behind the policy worker: values, training, building from a causal LM."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from rl_models.interfaces import Values
from rl_models.modeling.build import build_model
from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import TINY_LLAMA, skewed_batch, tiny_config

VALUE_MODEL = {"hf_config": TINY_LLAMA, "dtype": "float64", "kind": "value"}


def critic_config(**overrides) -> PolicyConfig:
    return tiny_config(model=VALUE_MODEL, **overrides)


class SquaredErrorToTarget:
    """0.5 * (V - target)^2 over the loss tokens, a mean over the global token count."""

    input_type = Values

    def __call__(self, values, data, global_valid_seqs, global_valid_toks):

        mask = data.loss_token_mask().to(values)
        err = torch.where(mask > 0, values - data.extras["target"].to(values), 0.0)
        return 0.5 * (err.square() * mask).sum() / global_valid_toks.to(values), {}


def reference_values(model, data) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain HF token classifier, each sequence alone and unpadded: its output at t - 1 values
    token t; the output at the last token is the final value."""
    values = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    final = torch.zeros(data.size, dtype=torch.float64)
    with torch.no_grad():
        for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
            out = model.eval()(ids[None, :n]).logits[0, :, 0]
            values[row, 1:n] = out[:-1]
            final[row] = out[-1]
    return values, final


@pytest.mark.parametrize(
    "batching",
    [
        {"logprob_micro_batch_size": 3},
        {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 70}},
        {"dynamic_batching": {"enabled": True, "train_mb_tokens": 80}},
    ],
    ids=["microbatches", "packed", "dynamic"],
)
def test_values_are_the_token_classifier_run_on_each_sequence_alone(batching):
    data = skewed_batch()
    worker = DTensorPolicyWorker(critic_config(**batching))
    got = worker.get_values(data)
    values, final = reference_values(build_model(worker.config.model, 0), data)
    assert got["values"].abs().sum() > 0
    torch.testing.assert_close(got["values"], values, rtol=0, atol=1e-10)
    torch.testing.assert_close(got["final_values"], final, rtol=0, atol=1e-10)


def test_a_value_model_has_no_logprobs_and_trains_only_on_value_losses():
    from rl_models.losses import NLLLoss

    worker = DTensorPolicyWorker(critic_config())
    with pytest.raises(ValueError, match=r"value model has no logprobs \(model.kind: value\)"):
        worker.get_logprobs(skewed_batch())
    with pytest.raises(ValueError, match="input_type Values"):
        worker.train(skewed_batch(), NLLLoss())


def test_a_value_model_is_refused_by_the_megatron_backend():
    with pytest.raises(ValueError, match=r"model\.kind=value"):
        critic_config(backend="megatron")


def test_a_critic_built_from_a_causal_lm_keeps_its_backbone_and_draws_its_head(tiny_llama):
    from rl_models.modeling.config import ModelConfig

    from_lm = ModelConfig(path=tiny_llama, kind="value", dtype="float64")
    critic = build_model(from_lm, seed=5)
    lm = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64)
    backbone = critic.model.state_dict()
    for name, tensor in lm.model.state_dict().items():
        torch.testing.assert_close(backbone[name], tensor, rtol=0, atol=0, msg=name)
    # No dropout before the head (Hugging Face's token classifiers default to 0.1): the values
    # trained on must be the values asked for.
    assert critic.config.classifier_dropout == 0.0 and critic.dropout.p == 0.0
    head = critic.score.weight
    assert head.shape == (1, TINY_LLAMA["hidden_size"]) and head.abs().sum() > 0
    # The head is drawn from the seed: the same again, another with another seed.
    assert torch.equal(build_model(from_lm, seed=5).score.weight, head)
    assert not torch.equal(build_model(from_lm, seed=6).score.weight, head)


def test_a_critic_saved_by_plain_transformers_loads_with_its_head_and_no_dropout(tmp_path):
    """Files of a token classifier saved outside this library (no classifier_dropout in its
    config, which a Llama model's __init__ would refuse as an argument) hold the head: it is
    loaded, not drawn, and the dropout before it is still 0."""
    from transformers import AutoConfig

    from rl_models.modeling.config import ModelConfig

    config = AutoConfig.for_model(**{**TINY_LLAMA, "num_labels": 1})
    torch.manual_seed(0)
    saved = AutoModelForTokenClassification.from_config(config, dtype=torch.float64)
    saved.save_pretrained(tmp_path)
    assert "classifier_dropout" not in (tmp_path / "config.json").read_text()
    critic = build_model(ModelConfig(path=str(tmp_path), kind="value", dtype="float64"), seed=5)
    assert torch.equal(critic.score.weight, saved.score.weight)
    assert critic.dropout.p == 0.0


def test_critic_training_does_not_depend_on_the_split_and_round_trips(tmp_path):
    data = skewed_batch()
    data["extras.target"] = torch.linspace(
        -1.0, 1.0, data["input_ids"].numel(), dtype=torch.float64
    )
    data["extras.target"] = data["extras.target"].view(data["input_ids"].shape)
    one = DTensorPolicyWorker(critic_config(train_micro_batch_size=8))
    before = one.get_values(data)["values"]
    one.train(data, SquaredErrorToTarget())
    many = DTensorPolicyWorker(
        critic_config(sequence_packing={"enabled": True, "max_tokens_per_microbatch": 64})
    )
    many.train(data, SquaredErrorToTarget())
    a, b = one.model.state_dict(), many.model.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-10
    after = one.get_values(data)["values"]
    assert float((after - before).abs().max()) > 1e-3

    one.save_checkpoint(str(tmp_path))
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path, dtype=torch.float64)
    values, _ = reference_values(loaded, data)
    torch.testing.assert_close(after, values, rtol=0, atol=1e-10)
    restored = DTensorPolicyWorker(critic_config())
    restored.load_checkpoint(str(tmp_path))
    torch.testing.assert_close(restored.get_values(data)["values"], after, rtol=0, atol=1e-10)
