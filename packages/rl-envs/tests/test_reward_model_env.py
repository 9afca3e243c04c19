import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from rl_envs.reward_model_env import RewardModelEnvConfig, RewardModelEnvironment

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "user: what is 2 + 2?",
    "assistant: 4",
] * 50


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=500,
            special_tokens=["<pad>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_scores_equal_a_plain_forward_pass_per_conversation(model_dir):
    env = RewardModelEnvironment(
        RewardModelEnvConfig(model_path=str(model_dir), batch_size=3, dtype="float64")
    )
    logs = [
        [{"role": "user", "content": "what is 2 + 2?"}, {"role": "assistant", "content": "4" * n}]
        for n in range(1, 6)  # different lengths: batches are padded
    ]
    out = env.step(logs, [{}] * len(logs))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = LlamaForSequenceClassification.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        expected = [
            model(**tokenizer(f"user: what is 2 + 2?\nassistant: {'4' * n}", return_tensors="pt"))
            .logits[0, 0]
            .item()
            for n in range(1, 6)
        ]
    assert out.rewards.tolist() == pytest.approx(expected, abs=1e-5)
    assert len(set(out.rewards.tolist())) == 5  # the scores do depend on the response
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
    assert metrics["samples"] == 5 and metrics["verifier_errors"] == 0


def test_a_model_with_more_than_one_label_is_refused(tmp_path, model_dir):
    config = LlamaConfig.from_pretrained(model_dir)
    config.num_labels = 2
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    PreTrainedTokenizerFast.from_pretrained(model_dir).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="one label"):
        RewardModelEnvironment(RewardModelEnvConfig(model_path=str(tmp_path)))
