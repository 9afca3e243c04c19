"""Shared fixtures: one small tokenizer per test session (importing transformers costs seconds)."""

from __future__ import annotations

import pytest

from rl_data.templates import ChatTemplate, ChatTemplateConfig

CORPUS = [
    "What is 2 + 2? The answer is 4.",
    "Hello! How can I help you today?",
    "You are a helpful assistant. Answer briefly and show your reasoning.",
    "The quick brown fox jumps over the lazy dog, then the dog sleeps again.",
    "Write a haiku about the sea. Waves fold into foam; salt wind carries gull voices.",
    "Compute 17 * 3 and 125 - 48. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.",
] * 20


@pytest.fixture(scope="session")
def tokenizer():
    from rl_data.tokenizers import build_tokenizer

    return build_tokenizer(CORPUS, vocab_size=500)


@pytest.fixture(scope="session")
def template(tokenizer):
    return ChatTemplate.from_config(ChatTemplateConfig(), tokenizer)
