import json

import pytest
import torch

from rl_data.messages import (
    check_messages,
    check_tools,
    tokenize_message_logs,
    truncate_message_log,
)
from rl_data.templates import ChatTemplate, ChatTemplateConfig


def test_concatenated_message_ids_equal_apply_chat_template(tokenizer, template):
    log = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "The answer is 4."},
    ]
    tokenize_message_logs([log], tokenizer, template)
    ours = torch.cat([m["token_ids"] for m in log]).tolist()
    theirs = tokenizer.apply_chat_template(log, tokenize=True, return_dict=False)
    assert ours == list(theirs)


def test_appending_turns_never_retokenises_earlier_ones(tokenizer, template):
    # re-tokenising "Numbers: 4" + "2 ..." as one text could merge "42" across the boundary
    log = [{"role": "user", "content": "Numbers: 4"}]
    tokenize_message_logs(
        [log],
        tokenizer,
        ChatTemplate.from_config(ChatTemplateConfig(kind="passthrough"), tokenizer),
    )
    first = log[0]["token_ids"]
    first_values = first.tolist()
    log.append({"role": "assistant", "content": "2 and more"})
    log.append({"role": "user", "content": "2 again"})
    tokenize_message_logs(
        [log],
        tokenizer,
        ChatTemplate.from_config(ChatTemplateConfig(kind="passthrough"), tokenizer),
    )
    assert log[0]["token_ids"] is first and first.tolist() == first_values
    whole = tokenizer("Numbers: 42 and more2 again", add_special_tokens=False)["input_ids"]
    ours = torch.cat([m["token_ids"] for m in log]).tolist()
    assert tokenizer.decode(ours) == tokenizer.decode(whole)
    assert ours[: len(first_values)] == first_values


def test_multi_turn_chat_template_keeps_turn_one(tokenizer, template):
    log = [{"role": "user", "content": "Hello!"}]
    tokenize_message_logs([log], tokenizer, template, add_generation_prompt=True)
    turn_one = log[0]["token_ids"].clone()
    log.append({"role": "assistant", "content": "How can I help you today?"})
    log.append({"role": "user", "content": "Compute 17 * 3."})
    tokenize_message_logs([log], tokenizer, template, add_generation_prompt=True)
    assert torch.equal(log[0]["token_ids"], turn_one)
    text = tokenizer.decode(torch.cat([m["token_ids"] for m in log]))
    assert text == template.render(log, add_generation_prompt=True)


def test_check_messages_names_the_problem():
    with pytest.raises(ValueError, match=r"messages\[1\] has role 'bot'"):
        check_messages([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}])
    with pytest.raises(
        ValueError, match=r"messages\[0\] \(user\) content must be a string, got int"
    ):
        check_messages([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match=r"has no 'content'"):
        check_messages([{"role": "user"}])
    with pytest.raises(ValueError, match="non-empty list"):
        check_messages([])


def test_truncate_keeps_the_first_tokens():
    log = [
        {"role": "user", "content": "a", "token_ids": torch.arange(5)},
        {"role": "assistant", "content": "b", "token_ids": torch.arange(5, 9)},
    ]
    cut = truncate_message_log(log, 7)
    assert [m["token_ids"].tolist() for m in cut] == [[0, 1, 2, 3, 4], [5, 6]]
    assert len(log[1]["token_ids"]) == 4  # the original is untouched


# -- tool calls and tools ---------------------------------------------------------------------

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def _calling(*calls):
    return [{"role": "user", "content": "1+2?"}, {"role": "assistant", "tool_calls": list(calls)}]


def test_tool_call_arguments_given_as_json_are_parsed_for_templates():
    call = {"type": "function", "id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}}
    reply = {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "3"}
    checked = check_messages([*_calling(call), reply])
    assert checked[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "add", "arguments": {"a": 1}}}
        ],
    }
    assert checked[2] == reply
    assert call["function"]["arguments"] == '{"a": 1}'  # the row itself is left as it was


def test_bad_tool_calls_and_replies_say_what_is_wrong():
    def fails(messages, match):
        with pytest.raises(ValueError, match=match):
            check_messages(messages)

    fn = {"name": "add", "arguments": "{}"}
    fails(
        _calling({"type": "function", "function": {**fn, "arguments": "{a: 1"}}),
        r"messages\[1\] tool_calls\[0\] arguments are not valid JSON",
    )
    fails(
        _calling({"type": "function", "function": {**fn, "arguments": "[1, 2]"}}),
        "arguments must be a JSON object",
    )
    fails(
        _calling({"type": "function", "function": {"arguments": "{}"}}),
        r"tool_calls\[0\] function has no 'name'",
    )
    fails(
        _calling({"name": "add", "arguments": {}}),
        r'tool_calls\[0\] must be \{"type": "function", "function"',
    )
    fails(_calling({"type": "code", "function": fn}), r"tool_calls\[0\] must be")
    fails(
        _calling({"type": "function", "function": {**fn, "arguments": "[" * 5000 + "]" * 5000}}),
        r"tool_calls\[0\] arguments are nested too deeply",
    )
    fails(
        [{"role": "user", "content": "x", "tool_calls": [{"function": fn}]}],
        r"messages\[0\] \(user\) has tool_calls; only assistants",
    )
    fails(
        [{"role": "user", "content": "x", "tool_call_id": "c1"}],
        "has tool_call_id; only tool replies",
    )
    fails(
        [{"role": "tool", "content": "3", "tool_call_id": 7}],
        r"messages\[0\] \(tool\) tool_call_id must be a string",
    )
    answered_twice = [
        *_calling({"id": "c1", "function": fn}),
        {"role": "tool", "tool_call_id": "c2", "content": "3"},
    ]
    fails(
        answered_twice,
        r"messages\[2\] \(tool\) answers tool_call_id 'c2', but the calls before it have ids \['c1'\]",
    )


def test_check_tools_takes_schemas_or_their_json_and_drops_arrow_nulls():
    assert check_tools([ADD]) == [ADD]
    assert check_tools(json.dumps([ADD])) == [ADD]
    # Arrow gives every tool the union of all tools' keys, nulls where a tool has none
    with_nulls = {"type": "function", "function": {**ADD["function"], "description": None}}
    assert check_tools([with_nulls]) == [ADD]


def test_check_tools_names_the_bad_tool():
    with pytest.raises(ValueError, match="tools must be a list of function schemas"):
        check_tools({"name": "add"})
    with pytest.raises(ValueError, match="tools is a string but not JSON"):
        check_tools("[{")
    with pytest.raises(ValueError, match="tools is nested too deeply"):
        check_tools("[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match=r'tools\[1\] must be \{"type": "function"'):
        check_tools([ADD, {"name": "sub"}])
    with pytest.raises(ValueError, match=r"tools\[0\] function has no 'name'"):
        check_tools([{"type": "function", "function": {"description": "?"}}])
    with pytest.raises(ValueError, match=r"tools\[0\] \(add\) parameters must be a JSON schema"):
        check_tools([{"type": "function", "function": {"name": "add", "parameters": "a, b"}}])
