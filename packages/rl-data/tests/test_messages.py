import pytest
import torch

from rl_data.messages import check_messages, tokenize_message_logs, truncate_message_log
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
