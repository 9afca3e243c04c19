import pickle

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


# -- frames: the text around each message, rendered once per sequence of roles ---------------

SMOL_LIKE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRIMMING = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
THINK_SPLITTING = (  # drops the reasoning of assistant turns, as Qwen3's template does
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['role'] == 'assistant' and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "</{{ m['role'] }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello!\n"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<think>no</think> 2+2?"},
        {"role": "assistant", "content": "<think>easy</think>4"},
        {"role": "user", "content": "{{ again }}"},
    ],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize(
    "source", [SMOL_LIKE, TRIMMING, THINK_SPLITTING], ids=["smol", "trim", "think"]
)
@pytest.mark.parametrize("gen", [False, True])
def test_framed_texts_equal_rendered_texts(source, gen):
    framed, rendered = ChatTemplate(source), ChatTemplate(source, cache_frames=False)
    for conversation in CONVERSATIONS:
        for start in range(len(conversation)):
            want = rendered.message_texts(conversation, gen, start=start)
            assert framed.message_texts(conversation, gen, start=start) == want
            assert framed.message_texts(conversation, gen, start=start) == want  # cached


def test_templates_that_change_contents_are_never_framed():
    roles = (("user", "assistant"), False, 0, None)  # roles, generation prompt, start, tools
    smol, trim, think = (
        ChatTemplate(SMOL_LIKE),
        ChatTemplate(TRIMMING),
        ChatTemplate(THINK_SPLITTING),
    )
    for t in (smol, trim, think):
        t.message_texts([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert smol._frames[roles] is not None
    assert trim._frames[roles] is None and think._frames[roles] is None


def _content_filter(expression: str) -> str:
    return (
        "{% for m in messages %}<{{ m['role'] }}>{{ " + expression + " }}</{{ m['role'] }}>"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )


# Content rewrites that leave the other probes untouched: Qwen3's template strips the newlines
# a final assistant turn starts with; others lower-case, truncate or normalise line ends.
SUBTLE = {
    "lstrip-newlines": _content_filter("m['content'].lstrip('\\n')"),
    "lower": _content_filter("m['content'] | lower"),
    "truncate": _content_filter("m['content'] | truncate(255)"),
    "crlf": _content_filter("m['content'].replace('\\r\\n', '\\n')"),
}
SUBTLE_CONVERSATION = [
    {"role": "user", "content": "\nWhat is 2+2? " + "Think it through. " * 20 + "\r\n"},
    {"role": "assistant", "content": "\n\nFour."},
]


@pytest.mark.parametrize("source", SUBTLE.values(), ids=SUBTLE.keys())
def test_subtle_content_rewrites_are_not_framed(source):
    framed, rendered = ChatTemplate(source), ChatTemplate(source, cache_frames=False)
    for gen in (False, True):
        for start in range(len(SUBTLE_CONVERSATION)):
            want = rendered.message_texts(SUBTLE_CONVERSATION, gen, start=start)
            assert framed.message_texts(SUBTLE_CONVERSATION, gen, start=start) == want


def test_a_template_pickles_and_renders_the_same(template):
    # Templates travel to Ray actors (the async GRPO collector renders prompts there).
    import pickle

    copy = pickle.loads(pickle.dumps(template))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert copy.render(messages) == template.render(messages)
    assert copy.special_tokens == template.special_tokens


# A template in the style of Qwen3's: {% generation %} blocks around what the assistant writes,
# a switch read from the template's kwargs (an empty think block when thinking is off), and a
# test on whether tools are defined.
THINKING_TEMPLATE = (
    "{% if tools is defined and tools is none %}[no tools]\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'assistant' %}{% generation %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{{ message.content }}<|im_end|>"
    "{% endgeneration %}{% else %}{{ message.content }}<|im_end|>{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("gen", [False, True])
def test_generation_blocks_and_kwargs_render_like_transformers(tokenizer, kwargs, gen):
    from rl_data.tokenizers import TokenizerConfig

    cfg = TokenizerConfig(
        path="unused",
        chat_template={"kind": "jinja", "template": THINKING_TEMPLATE},
        chat_template_kwargs=kwargs,
    )
    assert cfg.chat_template.kwargs == kwargs
    template = ChatTemplate.from_config(cfg.chat_template, tokenizer)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ]
    expected = tokenizer.apply_chat_template(
        msgs, chat_template=THINKING_TEMPLATE, tokenize=False, add_generation_prompt=gen, **kwargs
    )
    assert template.render(msgs, add_generation_prompt=gen) == expected
    assert "".join(template.message_texts(msgs, add_generation_prompt=gen)) == expected
    thinking_off = kwargs.get("enable_thinking") is False  # the kwarg reached the template
    assert expected.count("<think>") == thinking_off * (1 + gen)
    assert pickle.loads(pickle.dumps(template)).render(msgs, gen) == expected


def test_chat_template_kwargs_is_one_key_with_chat_template_kwargs():
    from rl_data.tokenizers import TokenizerConfig

    with pytest.raises(ValueError, match="not both"):
        TokenizerConfig(
            path="x",
            chat_template={"kwargs": {"enable_thinking": True}},
            chat_template_kwargs={"enable_thinking": False},
        )


def test_frames_kept_are_bounded_least_recently_used_first(monkeypatch):
    import rl_data.templates

    monkeypatch.setattr(rl_data.templates, "_MAX_FRAMES", 2)
    framed, rendered = ChatTemplate(SMOL_LIKE), ChatTemplate(SMOL_LIKE, cache_frames=False)
    for n in (2, 3, 4, 2, 5):  # four sequences of roles, the first one used again
        assert framed.message_texts(CONVERSATION[:n]) == rendered.message_texts(CONVERSATION[:n])
    assert [roles for roles, *_ in framed._frames] == [
        tuple(m["role"] for m in CONVERSATION[:n]) for n in (2, 5)
    ]
