"""Chat templates, rendered so that each message's text can be tokenised on its own.

Three kinds, picked by :class:`ChatTemplateConfig`:

- ``tokenizer``: the tokenizer's own ``chat_template`` (what the model was trained with);
- ``passthrough``: the messages' contents concatenated, nothing added (base models, raw text);
- ``jinja``: a Jinja string given in the config.

All three are Jinja templates rendered the way transformers renders chat templates
(``trim_blocks``, ``lstrip_blocks``, a sandbox, ``{% generation %}`` blocks, ``tools`` and
``documents`` defined as None, extra variables such as Qwen3's ``enable_thinking`` from
``kwargs``), so a template that works with ``tokenizer.apply_chat_template`` renders the same
text here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import model_validator

from rl_data.errors import TemplateError
from rl_data.types import TENSOR_KEYS
from rl_distributed.config import ConfigModel

PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# Plain text for language-model SFT (TRL's "text" rows): the text, then EOS to end it.
RAW_TEXT_TEMPLATE = PASSTHROUGH_TEMPLATE + "{% if eos_token %}{{ eos_token }}{% endif %}"

# ChatML, the format of SmolLM2 and Qwen; what tokenizers built by this package use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateConfig(ConfigModel):
    """Which chat template turns message logs into text."""

    # tokenizer (the tokenizer's own chat template), jinja (the template given in template) or
    # passthrough.
    kind: Literal["tokenizer", "passthrough", "jinja"] = "tokenizer"
    template: str | None = None  # the Jinja source, for kind=jinja only
    # Render the fixed text around messages once per sequence of roles and reuse it (see
    # ChatTemplate.message_texts). Switch off for a template whose output depends on what a
    # message says beyond inserting it (the probes catch trimming, escaping, think-tag splitting,
    # case changes and truncation, not every possible test on the content).
    cache_frames: bool = True
    # Variables the template sees besides messages, e.g. {enable_thinking: false} for Qwen3
    # (what apply_chat_template's keyword arguments are).
    kwargs: dict[str, Any] = {}

    @model_validator(mode="after")
    def _template_only_for_jinja(self) -> ChatTemplateConfig:
        if self.kind == "jinja" and not self.template:
            raise ValueError("kind 'jinja' needs 'template' (a Jinja string)")
        if self.kind != "jinja" and self.template is not None:
            raise ValueError(f"'template' is only read for kind 'jinja', not {self.kind!r}")
        return self


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template raised: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks what the assistant generates, for
    transformers' assistant masks. The block renders as its body: masks here come from the
    message roles."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlocks, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template has a syntax error (line {e.lineno}): {e}") from None


_FRAMED_KEYS = TENSOR_KEYS | {"role", "content"}

# Probe contents for ChatTemplate frames ({i}: the message's index). Private-use characters
# make each unique; the others catch templates that trim, escape or split what a message says,
# or that strip leading newlines (Qwen3's last assistant turn), change case, normalise line
# ends or truncate (Jinja's ``truncate`` keeps 255 characters).
_PROBE_VARIANTS = (
    "\ue000{i}\ue001",
    "  \n\ue002{i}\ue003 \n\n",
    "<think>\ue004{i}</think>{{{{ x }}}}<tool_call>\ue005",
    "\n\r\n\tAb\ue006{i}\ue007" + "Probe Text. " * 25 + "Z\r\n",
)


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        cache_frames: bool = True,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.kwargs = dict(kwargs or {})
        self._template = _compile(source)
        self.cache_frames = cache_frames
        # (roles, add_generation_prompt, start) -> (before, after) text of each message, or
        # None where the template does not insert contents verbatim (then: render each time)
        self._frames: dict[tuple[tuple[str, ...], bool, int], list[tuple[str, str]] | None] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        # The compiled Jinja template does not pickle: rebuild it from its source (a template
        # travels to Ray actors, e.g. with a data loader whose dataset renders prompts).
        return type(self), (self.source, self.special_tokens, self.cache_frames, self.kwargs)

    @classmethod
    def from_config(cls, cfg: ChatTemplateConfig, tokenizer: Any = None) -> ChatTemplate:
        """The template ``cfg`` names; ``tokenizer`` supplies its own template and special tokens."""
        special = {}
        if tokenizer is not None:
            special = {
                name: getattr(tokenizer, name, None)
                for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            }
        if cfg.kind == "passthrough":
            return cls(PASSTHROUGH_TEMPLATE, special, cfg.cache_frames, cfg.kwargs)
        if cfg.kind == "jinja":
            assert cfg.template is not None
            return cls(cfg.template, special, cfg.cache_frames, cfg.kwargs)
        source = getattr(tokenizer, "chat_template", None)
        if not isinstance(source, str) or not source:
            name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
            raise TemplateError(
                f"tokenizer {name!r} has no chat template; use chat_template.kind 'passthrough'"
                " or 'jinja' with a template"
            )
        return cls(source, special, cfg.cache_frames, cfg.kwargs)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False
    ) -> str:
        if not messages:
            return ""
        plain = [{k: v for k, v in m.items() if k not in TENSOR_KEYS} for m in messages]
        # the variables apply_chat_template passes: tools and documents are always defined
        return self._template.render(
            messages=plain,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **self.kwargs,
        )

    def message_texts(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        start: int = 0,
    ) -> list[str]:
        """The text each of ``messages[start:]`` adds to the rendered conversation.

        Joined, the texts of all messages are exactly ``render(messages, add_generation_prompt)``.
        The header the template writes before an assistant turn (``<|im_start|>assistant\\n``)
        belongs to the message before it, so an assistant message's text is exactly what the
        policy generates after the generation prompt, in SFT as in RL. Texts are taken as the
        difference between renders of successive prefixes, so a template that rewrites earlier
        turns when a later one is added (e.g. one that drops past reasoning) is refused: it
        cannot be tokenised incrementally.

        Rendering costs more than tokenising, so the text a template puts around each message
        (headers, end-of-turn markers, a default system prompt) is found once per sequence of
        roles, by rendering probe contents, and reused: each message's text is then its frame's
        ``before + content + after``. Probes with whitespace, line ends, mixed case, braces,
        think/tool tags and more than 255 characters must
        all come out verbatim in the same frame, else that sequence is rendered every time, as
        are messages with empty content.
        """
        # Frames hold only what the template writes around a content, so a message with more
        # than a role and a content (tool calls...) is rendered each time.
        if self.cache_frames and all(
            m["content"] and m.keys() <= _FRAMED_KEYS for m in messages[start:]
        ):
            frame = self._frame(tuple(m["role"] for m in messages), add_generation_prompt, start)
            if frame is not None:
                return [
                    before + m["content"] + after
                    for (before, after), m in zip(frame, messages[start:], strict=True)
                ]
        return self._rendered_texts(messages, add_generation_prompt, start)

    def _frame(
        self, roles: tuple[str, ...], add_generation_prompt: bool, start: int
    ) -> list[tuple[str, str]] | None:
        key = (roles, add_generation_prompt, start)
        if key not in self._frames:
            self._frames[key] = self._probe_frame(roles, add_generation_prompt, start)
        return self._frames[key]

    def _probe_frame(
        self, roles: tuple[str, ...], add_generation_prompt: bool, start: int
    ) -> list[tuple[str, str]] | None:
        frames = []
        for variant in _PROBE_VARIANTS:
            contents = [variant.format(i=i) for i in range(len(roles))]
            probe = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
            try:
                texts = self._rendered_texts(probe, add_generation_prompt, start)
            except TemplateError:
                return None  # let the real messages raise (or pass) on their own
            frame = []
            for text, content, i in zip(
                texts, contents[start:], range(start, len(roles)), strict=True
            ):
                others = [c for j, c in enumerate(contents) if j != i]
                if text.count(content) != 1 or any(o in text for o in others):
                    return None  # not inserted verbatim, or moved into another message's text
                before, _, after = text.partition(content)
                frame.append((before, after))
            frames.append(frame)
        return frames[0] if all(f == frames[0] for f in frames) else None

    def _rendered_texts(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        start: int,
    ) -> list[str]:
        """``message_texts`` by rendering every prefix of the conversation."""
        n = len(messages)

        def boundary(k: int) -> str:
            # the rendered text once the first k messages are in
            gen = (k < n and messages[k]["role"] == "assistant") or (
                k == n and add_generation_prompt
            )
            return self.render(messages[:k], add_generation_prompt=gen)

        texts = []
        prev = boundary(start)
        for k in range(start + 1, n + 1):
            cur = boundary(k)
            if not cur.startswith(prev):
                raise TemplateError(
                    f"the chat template changes the text of earlier messages when message {k - 1}"
                    f" ({messages[k - 1]['role']}) is added, so messages cannot be tokenised"
                    " one at a time; use a template that only appends"
                )
            texts.append(cur[len(prev) :])
            prev = cur
        return texts
