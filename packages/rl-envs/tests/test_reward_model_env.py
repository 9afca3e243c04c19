import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
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


@pytest.fixture(scope="module")
def templated_model_dir(tmp_path_factory, model_dir):
    """The same model, with a tokenizer that adds <bos> itself and a chat template that also
    writes it: the Llama-style pair that gave a double BOS."""
    path = tmp_path_factory.mktemp("rm_templated")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"bos_token": "<bos>"})
    backend = tokenizer.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_token_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id  # it does add one
    config = LlamaConfig.from_pretrained(model_dir)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_templated_text_gets_one_bos_and_long_ones_keep_the_response_end(templated_model_dir):
    path = templated_model_dir
    env = RewardModelEnvironment(
        RewardModelEnvConfig(model_path=str(path), dtype="float64", max_length=12)
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    short = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    ids = env.encode(short)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    long = [
        {"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 3},
        {"role": "assistant", "content": "the lazy dog"},
    ]
    full = tokenizer(tokenizer.apply_chat_template(long, tokenize=False), add_special_tokens=False)
    assert len(full["input_ids"]) > 12
    assert env.encode(long) == full["input_ids"][-12:]  # the prompt's start is what goes
    assert tokenizer.decode(env.encode(long)).rstrip().endswith("assistant: the lazy dog")
    out = env.step([short, long], [{}, {}])
    model = LlamaForSequenceClassification.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        expected = [
            model(input_ids=torch.tensor([ids])).logits[0, 0].item(),
            model(input_ids=torch.tensor([full["input_ids"][-12:]])).logits[0, 0].item(),
        ]
    assert out.rewards.tolist() == pytest.approx(expected, abs=1e-5)
