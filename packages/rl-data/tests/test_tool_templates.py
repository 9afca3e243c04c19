"""Tools in the template: real chat templates (tests/fixtures/chat_templates, see SOURCES.md)
render tool-use conversations here exactly as ``apply_chat_template(..., tools=...)`` does, token
for token, message by message; SFT trains on the assistant's calls and answers only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_data.collate import sft_collate
from rl_data.datasets import ChatFileConfig, load_dataset
from rl_data.errors import TemplateError
from rl_data.messages import check_messages, tokenize_message_logs
from rl_data.processors import ProcessedDataset
from rl_data.templates import (
    CHATML_TEMPLATE,
    CHATML_TOOLS_TEMPLATE,
    ChatTemplate,
    ChatTemplateConfig,
)
from rl_data.tokenizers import TokenizerConfig, build_tokenizer
from rl_data.types import TOOLS_KEY

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name."}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "The sum of two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first."},
                    "b": {"type": "integer", "description": "The second."},
                },
                "required": ["a", "b"],
            },
        },
    },
]


def call(n: int, name: str, arguments: str) -> dict[str, Any]:
    # arguments as a JSON string, as OpenAI writes them: rows are checked into dicts
    return {
        "type": "function",
        "id": f"call_{n}",
        "function": {"name": name, "arguments": arguments},
    }


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = {"role": "user", "content": "What's the weather in Paris, and what is 2 + 3?"}
TWO_CALLS = {
    "role": "assistant",
    "content": "",
    "tool_calls": [call(0, "get_weather", '{"city": "Paris"}'), call(1, "add", '{"a": 2, "b": 3}')],
}
ONE_CALL = {"role": "assistant", "content": "", "tool_calls": TWO_CALLS["tool_calls"][:1]}
WEATHER = {"role": "tool", "tool_call_id": "call_0", "content": "Sunny, 21 C"}
SUM = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
ANSWER = {"role": "assistant", "content": "It is sunny in Paris (21 C), and 2 + 3 = 5."}
THANKS = [{"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "Welcome."}]
# Parallel calls, two tool replies in a row (Qwen closes their turn after the last), then a
# plain exchange.
TRACE = [SYSTEM, QUESTION, TWO_CALLS, WEATHER, SUM, ANSWER, *THANKS]


def _reasoning(message: dict[str, Any]) -> dict[str, Any]:
    return {**message, "reasoning_content": "Let me think."}


# How Llama 3's and Qwen2's tokenizers cut text before BPE (from their tokenizer.json): unlike
# GPT-2's (SmolLM2's), punctuation keeps the line ends after it, so ">" | "\n" cut between two
# messages would tokenise differently from the whole text.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Case:
    """A template, the tokens its model's tokenizer keeps whole, and a conversation it takes."""

    source: str
    conversation: list[dict[str, Any]]
    split: str | None = LLAMA3_SPLIT  # None: GPT-2's
    eos: str = "<|im_end|>"
    bos: str | None = None
    specials: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")
    added: tuple[str, ...] = ()  # tokens the tokenizer has whole but does not call special
    kwargs: dict[str, Any] = field(default_factory=dict)


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


CASES = {
    "qwen2.5": Case(
        _fixture("qwen2.5-instruct.jinja"), TRACE, added=("<tool_call>", "</tool_call>")
    ),
    # one call per turn (the template refuses more), tools in the first user turn, today's date
    # pinned (it reads the clock otherwise)
    "llama3.2": Case(
        _fixture("llama-3.2-instruct.jinja"),
        [SYSTEM, QUESTION, ONE_CALL, WEATHER, ANSWER, *THANKS],
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
        specials=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        kwargs={"date_string": "26 Jul 2024"},
    ),
    "hermes3": Case(
        _fixture("hermes-3-llama-3.1-tool-use.jinja"),
        TRACE,
        bos="<|begin_of_text|>",
        added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    # Qwen3 drops the reasoning of turns before the last question: one question, reasoning on
    # every turn after it
    "qwen3": Case(
        _fixture("qwen3.jinja"),
        [SYSTEM, QUESTION, _reasoning(TWO_CALLS), WEATHER, SUM, _reasoning(ANSWER)],
        added=("<tool_call>", "</tool_call>", "<think>", "</think>"),
    ),
    # ours, for SmolLM2, whose tokenizer has no tool tokens
    "chatml_tools": Case(CHATML_TOOLS_TEMPLATE, TRACE, split=None),
}


@cache
def _setup(name: str) -> tuple[Any, ChatTemplate]:
    """A tokenizer like the model's (its special and added tokens; BPE merges learnt on this
    very conversation, so that merges across message boundaries would show) and the template."""
    case = CASES[name]
    conversation = check_messages(case.conversation)
    rendered = ChatTemplate(case.source, {"bos_token": case.bos}, kwargs=case.kwargs).render(
        conversation, tools=TOOLS
    )
    tokenizer = build_tokenizer([rendered] * 20, vocab_size=1000, split_pattern=case.split)
    special = {"eos_token": case.eos, "extra_special_tokens": list(case.specials)}
    tokenizer.add_special_tokens({**special, **({"bos_token": case.bos} if case.bos else {})})
    tokenizer.add_tokens(list(case.added))
    cfg = (
        ChatTemplateConfig(kind="chatml_tools", kwargs=case.kwargs)
        if name == "chatml_tools"
        else ChatTemplateConfig(kind="jinja", template=case.source, kwargs=case.kwargs)
    )
    return tokenizer, ChatTemplate.from_config(cfg, tokenizer)


def _expected(name: str, messages: list[dict[str, Any]], gen: bool, tokenize: bool) -> Any:
    tokenizer, _ = _setup(name)
    return tokenizer.apply_chat_template(
        messages,
        tools=TOOLS,
        chat_template=CASES[name].source,
        tokenize=tokenize,
        add_generation_prompt=gen,
        return_dict=False,
        **CASES[name].kwargs,
    )


def _conversation(name: str, gen: bool) -> list[dict[str, Any]]:
    messages = check_messages(CASES[name].conversation)
    return messages[:-1] if gen else messages  # a prompt: up to the turn to generate


@pytest.mark.parametrize("gen", [False, True], ids=["sft", "prompt"])
@pytest.mark.parametrize("name", CASES)
def test_rendering_with_tools_equals_apply_chat_template(name, gen):
    _, template = _setup(name)
    messages = _conversation(name, gen)
    expected = _expected(name, messages, gen, tokenize=False)
    assert "get_weather" in expected and "Sunny, 21 C" in expected  # tools and replies rendered
    assert template.render(messages, gen, tools=TOOLS) == expected
    texts = template.message_texts(messages, gen, tools=TOOLS)
    assert "".join(texts) == expected
    # each message's text holds what it says: calls in the assistant's, replies in the tool's
    for message, text in zip(messages, texts, strict=True):
        if message["role"] == "tool":
            assert message["content"] in text
        for c in message.get("tool_calls", []):
            assert json.dumps(c["function"]["arguments"]) in text
        if message["role"] == "assistant" and message["content"]:
            assert message["content"] in text


@pytest.mark.parametrize("gen", [False, True], ids=["sft", "prompt"])
@pytest.mark.parametrize("name", CASES)
def test_message_token_ids_joined_equal_apply_chat_template_ids(name, gen):
    tokenizer, template = _setup(name)
    messages = _conversation(name, gen)
    log = [dict(m) for m in messages]
    tokenize_message_logs([log], tokenizer, template, gen, tools=[TOOLS])
    ours = torch.cat([m["token_ids"] for m in log]).tolist()
    assert ours == list(_expected(name, messages, gen, tokenize=True))


@pytest.mark.parametrize("name", CASES)
def test_frames_are_kept_per_set_of_tools(name):
    # Messages with only a role and a content reuse the text around them, which holds the
    # tools: a frame found for one set of tools must not serve another.
    _, template = _setup(name)
    plain = [SYSTEM, QUESTION, ANSWER, *(THANKS if name != "qwen3" else [])]
    unframed = ChatTemplate(template.source, template.special_tokens, False, template.kwargs)
    for tools in (TOOLS, TOOLS[:1], TOOLS):
        texts = template.message_texts(plain, tools=tools)
        assert texts == unframed.message_texts(plain, tools=tools)
        assert "get_weather" in "".join(texts)
        assert ('"add"' in "".join(texts)) == (tools is TOOLS)


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.2", "chatml_tools"])
def test_sft_trains_on_the_assistants_calls_and_answers_only(name, tmp_path):
    tokenizer, template = _setup(name)
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"messages": CASES[name].conversation, "tools": TOOLS}) + "\n")
    rows = load_dataset(ChatFileConfig(path=str(path)))
    datum = ProcessedDataset(rows, tokenizer, template, "sft")[0]
    assert datum["extra_env_info"] == {TOOLS_KEY: TOOLS}
    batch = sft_collate([datum], pad_token_id=tokenizer.pad_token_id)
    ids, mask = batch.input_ids[0], batch.loss_mask[0].bool()
    messages = check_messages(CASES[name].conversation)
    assert ids.tolist() == list(_expected(name, messages, False, tokenize=True))

    trained = tokenizer.decode(ids[mask].tolist())
    texts = template.message_texts(messages, tools=TOOLS)
    assert trained == "".join(
        t for m, t in zip(messages, texts, strict=True) if m["role"] == "assistant"
    )
    assert '"city": "Paris"' in trained and ANSWER["content"] in trained and "Welcome." in trained
    for untrained in ("Sunny, 21 C", QUESTION["content"], SYSTEM["content"], "The city's name."):
        assert untrained not in trained


def test_a_prompt_is_rendered_with_its_rows_tools(tmp_path):
    # RL: the prompt processor's sample renders with the tools, and carries them for the
    # environment
    tokenizer, template = _setup("qwen2.5")
    path = tmp_path / "prompts.jsonl"
    row = {"prompt": [SYSTEM, QUESTION], "tools": json.dumps(TOOLS), "answer": "5"}
    path.write_text(json.dumps(row) + "\n")
    datum = ProcessedDataset(
        load_dataset(ChatFileConfig(path=str(path))), tokenizer, template, "prompt"
    )[0]
    assert datum["extra_env_info"] == {"answer": "5", TOOLS_KEY: TOOLS}
    ids = torch.cat([m["token_ids"] for m in datum["message_log"]]).tolist()
    assert ids == list(_expected("qwen2.5", [SYSTEM, QUESTION], True, tokenize=True))


def test_a_row_without_tools_is_offered_its_tasks_tools(tmp_path):
    """``default_tools``: what the task's environment offers a row without a ``tools`` column
    (a tool environment's configured tools); a row's own column wins."""
    tokenizer, template = _setup("qwen2.5")
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": [SYSTEM, QUESTION], "answer": "5"},
        {"prompt": [SYSTEM, QUESTION], "answer": "5", "tools": TOOLS[:1]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def samples(task):
        rows = load_dataset(ChatFileConfig(path=str(path), task_name=task))
        return ProcessedDataset(rows, tokenizer, template, "prompt", default_tools={"calc": TOOLS})

    calc, math = samples("calc"), samples("math")
    offered = [d["extra_env_info"].get(TOOLS_KEY) for d in (calc[0], calc[1], math[0], math[1])]
    assert offered == [TOOLS, TOOLS[:1], None, TOOLS[:1]]
    for datum, tools in zip((calc[0], calc[1]), (TOOLS, TOOLS[:1]), strict=True):
        ids = torch.cat([m["token_ids"] for m in datum["message_log"]]).tolist()
        expected = template.render([SYSTEM, QUESTION], add_generation_prompt=True, tools=tools)
        assert tokenizer.decode(ids) == expected


def test_turns_appended_to_a_tokenised_log_keep_earlier_ids():
    # A rollout: the prompt, then the assistant's calls, then both tool replies at once.
    tokenizer, template = _setup("qwen2.5")
    messages = check_messages(TRACE)
    log = [dict(m) for m in messages[:2]]
    tokenize_message_logs([log], tokenizer, template, True, tools=[TOOLS])
    prompt_ids = [m["token_ids"] for m in log]
    log.append(dict(messages[2]))
    tokenize_message_logs([log], tokenizer, template, False, tools=[TOOLS])
    log += [dict(messages[3]), dict(messages[4])]
    tokenize_message_logs([log], tokenizer, template, True, tools=[TOOLS])
    assert all(m["token_ids"] is ids for m, ids in zip(log, prompt_ids, strict=False))
    ours = torch.cat([m["token_ids"] for m in log]).tolist()
    assert ours == list(_expected("qwen2.5", messages[:5], True, tokenize=True))


def test_a_run_of_tool_replies_the_template_closes_at_its_end_goes_in_together():
    # Qwen's template closes the user turn holding tool replies after the last one, so a reply
    # tokenised alone would end with a close that the next reply removes: refused, with why.
    # Our ChatML gives each reply its own turn, so replies may come one at a time.
    for name, refused in (("qwen2.5", True), ("chatml_tools", False)):
        tokenizer, template = _setup(name)
        messages = check_messages(TRACE)
        log = [dict(m) for m in messages[:4]]
        tokenize_message_logs([log], tokenizer, template, tools=[TOOLS])
        log.append(dict(messages[4]))
        if refused:
            with pytest.raises(TemplateError, match=r"already tokenised.*tokenise them together"):
                tokenize_message_logs([log], tokenizer, template, tools=[TOOLS])
            continue
        tokenize_message_logs([log], tokenizer, template, tools=[TOOLS])
        ours = torch.cat([m["token_ids"] for m in log]).tolist()
        assert ours == list(_expected(name, messages[:5], False, tokenize=True))


def test_qwen3_dropping_past_reasoning_is_refused_not_mis_tokenised():
    # with a later question, Qwen3 drops the reasoning of the tool-calling turn before it: the
    # text of an earlier message changes, so messages cannot be tokenised one at a time
    _, template = _setup("qwen3")
    messages = check_messages([*CASES["qwen3"].conversation, *THANKS])
    with pytest.raises(TemplateError, match="changes the text of earlier messages"):
        template.message_texts(messages, tools=TOOLS)


def test_chatml_tools_is_plain_chatml_without_tools_and_selectable_from_config(tokenizer):
    cfg = TokenizerConfig(path="unused", chat_template={"kind": "chatml_tools"})
    template = ChatTemplate.from_config(cfg.chat_template, tokenizer)
    plain = [SYSTEM, QUESTION, ANSWER]
    assert template.render(plain, True) == ChatTemplate(CHATML_TEMPLATE).render(plain, True)
    assert template.render(plain[1:]).startswith("<|im_start|>user\n")  # no default system turn
    with pytest.raises(ValueError, match="only read for kind 'jinja'"):
        ChatTemplateConfig(kind="chatml_tools", template=CHATML_TEMPLATE)
