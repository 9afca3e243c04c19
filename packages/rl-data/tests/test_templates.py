import pytest

from rl_data.errors import TemplateError
from rl_data.templates import PASSTHROUGH_TEMPLATE, ChatTemplate, ChatTemplateConfig

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6"},
]


def test_tokenizer_template_renders_like_apply_chat_template(tokenizer, template):
    for gen in (False, True):
        msgs = CONVERSATION if not gen else CONVERSATION[:4]
        expected = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert template.render(msgs, add_generation_prompt=gen) == expected


def test_message_texts_join_to_the_rendered_conversation(template):
    texts = template.message_texts(CONVERSATION)
    assert len(texts) == len(CONVERSATION)
    assert "".join(texts) == template.render(CONVERSATION)


def test_assistant_text_is_what_the_policy_generates(template):
    texts = template.message_texts(CONVERSATION)
    # the assistant header ends the user turn, like a generation prompt
    assert texts[1] == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert texts[2] == "4<|im_end|>\n"


def test_generation_prompt_goes_on_the_last_message(template):
    texts = template.message_texts(CONVERSATION[:2], add_generation_prompt=True)
    assert texts[-1].endswith("<|im_start|>assistant\n")


def test_passthrough_concatenates_contents(tokenizer):
    t = ChatTemplate.from_config(ChatTemplateConfig(kind="passthrough"), tokenizer)
    assert t.render(CONVERSATION) == "Be brief.What is 2 + 2?4And 3 + 3?6"
    assert t.message_texts(CONVERSATION) == [m["content"] for m in CONVERSATION]


def test_jinja_template_from_config_sees_special_tokens(tokenizer):
    source = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    t = ChatTemplate.from_config(ChatTemplateConfig(kind="jinja", template=source), tokenizer)
    assert (
        t.render(CONVERSATION[:2]) == "[system] Be brief.<|im_end|>[user] What is 2 + 2?<|im_end|>"
    )


def test_config_rejects_jinja_without_template_and_template_without_jinja():
    with pytest.raises(ValueError, match="needs 'template'"):
        ChatTemplateConfig(kind="jinja")
    with pytest.raises(ValueError, match="only read for kind 'jinja'"):
        ChatTemplateConfig(kind="passthrough", template=PASSTHROUGH_TEMPLATE)


def test_template_that_rewrites_earlier_turns_is_refused():
    # renders only the last message: earlier text changes when a message is added
    t = ChatTemplate("{{ messages[-1]['content'] }}")
    with pytest.raises(TemplateError, match="changes the text of earlier messages"):
        t.message_texts(CONVERSATION)


def test_syntax_error_and_raise_exception_are_template_errors():
    with pytest.raises(TemplateError, match="syntax error"):
        ChatTemplate("{% for m in messages %}")
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="roles must alternate"):
        t.render(CONVERSATION)


def test_tokenizer_without_template_is_an_error(tokenizer):
    class NoTemplate:
        chat_template = None
        name_or_path = "plain-tokenizer"

    with pytest.raises(TemplateError, match=r"plain-tokenizer.*passthrough"):
        ChatTemplate.from_config(ChatTemplateConfig(), NoTemplate())
