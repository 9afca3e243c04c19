"""Chat templates, rendered so that each message's text can be tokenised on its own.

Four kinds, picked by :class:`ChatTemplateConfig`:

- ``tokenizer``: the tokenizer's own ``chat_template`` (what the model was trained with);
- ``passthrough``: the messages' contents concatenated, nothing added (base models, raw text);
- ``jinja``: a Jinja string given in the config;
- ``chatml_tools``: ChatML that knows tools (:data:`CHATML_TOOLS_TEMPLATE`), for models whose
  own template has none, such as SmolLM2.

All are Jinja templates rendered the way transformers renders chat templates (``trim_blocks``,
``lstrip_blocks``, a sandbox, ``{% generation %}`` blocks, the conversation's ``tools`` (None
when it has none), ``documents`` defined as None, extra variables such as Qwen3's
``enable_thinking`` from ``kwargs``), so a template renders here the text that
``tokenizer.apply_chat_template(messages, tools=tools)`` renders.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from importlib.resources import files
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
# ChatML with tools, Hermes style: the tools' JSON schemas in the system turn inside <tools>,
# each call as JSON inside <tool_call>, each tool reply in a user turn inside <tool_response>.
CHATML_TOOLS_TEMPLATE = files("rl_data").joinpath("chatml_tools.jinja").read_text()

# The tools a conversation is offered (OpenAI function schemas), as a template receives them.
Tools = Sequence[Mapping[str, Any]]


class ChatTemplateConfig(ConfigModel):
    """Which chat template turns message logs into text."""

    # tokenizer (the tokenizer's own chat template), jinja (the template given in template),
    # passthrough, or chatml_tools (ChatML that renders tools and tool calls, Hermes style: for a
    # model whose own template knows no tools, such as SmolLM2).
    kind: Literal["tokenizer", "passthrough", "jinja", "chatml_tools"] = "tokenizer"
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
        # (roles, add_generation_prompt, start, tools as JSON) -> (before, after) text of each
        # message, or None where the template does not insert contents verbatim (then: render
        # each time)
        self._frames: OrderedDict[_FrameKey, list[tuple[str, str]] | None] = OrderedDict()

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
        if cfg.kind == "chatml_tools":
            return cls(CHATML_TOOLS_TEMPLATE, special, cfg.cache_frames, cfg.kwargs)
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
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tools: Tools | None = None,
    ) -> str:
        """The conversation as text, offered ``tools`` (OpenAI function schemas) if any."""
        if not messages:
            return ""
        plain = [{k: v for k, v in m.items() if k not in TENSOR_KEYS} for m in messages]
        # the variables apply_chat_template passes: tools and documents are always defined
        return self._template.render(
            messages=plain,
            tools=tools,
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
        tools: Tools | None = None,
    ) -> list[str]:
        """The text each of ``messages[start:]`` adds to the rendered conversation.

        Joined, the texts of all messages are exactly ``render(messages, add_generation_prompt,
        tools)``. The header the template writes before an assistant turn
        (``<|im_start|>assistant\\n``) belongs to the message before it, so an assistant
        message's text is exactly what the policy generates after the generation prompt, in SFT
        as in RL; tools (which templates put in the system turn, or the first user turn) belong
        to the message they are rendered in.

        Texts are cut where the renders of successive prefixes of the conversation end. Two
        things a prefix may render differently from the whole conversation: the text after a
        message's content (Qwen's template closes a run of tool replies only after the last
        one: the cut then falls where the texts part, after any line ends there, which
        tokenizers such as Qwen's join to the punctuation before them), and nothing at all
        (Llama 3's template with tools refuses a conversation of only a system message: that
        message's text then goes with the next one). A template that changes what an earlier
        message says when a later one is added (e.g. one that drops past reasoning) is refused:
        it cannot be tokenised incrementally. So is one that changes the text of
        ``messages[:start]``, which are already tokenised.

        Rendering costs more than tokenising, so the text a template puts around each message
        (headers, end-of-turn markers, a default system prompt, the tools) is found once per
        sequence of roles and tools, by rendering probe contents, and reused: each message's
        text is then its frame's ``before + content + after``. Probes with whitespace, line
        ends, mixed case, braces, think/tool tags and more than 255 characters must all come out
        verbatim in the same frame, else that sequence is rendered every time, as are messages
        with empty content or with more than a role and a content (tool calls, tool call ids).
        """
        if self.cache_frames and all(
            m["content"] and m.keys() <= _FRAMED_KEYS for m in messages[start:]
        ):
            tools_key = None if tools is None else json.dumps(tools, sort_keys=True)
            key = (tuple(m["role"] for m in messages), add_generation_prompt, start, tools_key)
            if key in self._frames:
                self._frames.move_to_end(key)
            else:
                self._frames[key] = self._probe_frame(key[0], add_generation_prompt, start, tools)
                if len(self._frames) > _MAX_FRAMES:  # rows that each have their own tools
                    self._frames.popitem(last=False)
            frame = self._frames[key]
            if frame is not None:
                return [
                    before + m["content"] + after
                    for (before, after), m in zip(frame, messages[start:], strict=True)
                ]
        return self._rendered_texts(messages, add_generation_prompt, start, tools)

    def _probe_frame(
        self,
        roles: tuple[str, ...],
        add_generation_prompt: bool,
        start: int,
        tools: Tools | None,
    ) -> list[tuple[str, str]] | None:
        frames = []
        for variant in _PROBE_VARIANTS:
            contents = [variant.format(i=i) for i in range(len(roles))]
            probe = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
            try:
                texts = self._rendered_texts(probe, add_generation_prompt, start, tools)
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
        tools: Tools | None,
    ) -> list[str]:
        """``message_texts`` by rendering every prefix of the conversation."""
        n = len(messages)

        def prefix(k: int) -> str:
            # the rendered text once the first k messages are in
            gen = (k < n and messages[k]["role"] == "assistant") or (
                k == n and add_generation_prompt
            )
            return self.render(messages[:k], add_generation_prompt=gen, tools=tools)

        whole = prefix(n)
        done = prefix(start)
        if not whole.startswith(done):
            raise TemplateError(
                f"the chat template changes the text of messages 0-{start - 1}, which are already"
                f" tokenised, when message {start} ({messages[start]['role']}) is added;"
                " tokenise them together with it (a template may close a run of tool replies"
                " only after the last one)"
            )
        cuts = [len(done)]
        for k in range(start + 1, n):
            try:
                text = prefix(k)
            except TemplateError:
                cuts.append(cuts[-1])  # no text of its own: message k-1 goes with message k
                continue
            cut = len(text)
            if not whole.startswith(text):  # message k-1 ends otherwise once message k follows
                cut = _shared_prefix_length(text, whole)
                if not _content_kept(text, cut, messages[k - 1]):
                    cut = -1  # what it says changed, not only how it ends
                # Llama 3's and Qwen2's tokenizers keep line ends with the punctuation before
                # them (">\n" is one piece): line ends right after such a cut stay before it.
                else:
                    cut = len(whole) - len(whole[cut:].lstrip("\r\n"))
            if cut < cuts[-1]:
                raise TemplateError(
                    f"the chat template changes the text of earlier messages when message {k}"
                    f" ({messages[k]['role']}) is added, so messages cannot be tokenised one at"
                    " a time; use a template that only appends"
                )
            cuts.append(cut)
        cuts.append(len(whole))
        return [whole[a:b] for a, b in itertools.pairwise(cuts)]


_FrameKey = tuple[tuple[str, ...], bool, int, str | None]
# Frames kept per template, the least recently used dropped first: a frame holds the rendered
# tools, and data whose rows each offer their own tools would otherwise keep them all.
_MAX_FRAMES = 1024


def _shared_prefix_length(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` start with in common."""
    low, high = 0, min(len(a), len(b))  # a binary search: startswith runs in C, a loop would not
    while low < high:
        mid = (low + high + 1) // 2
        if b.startswith(a[:mid]):
            low = mid
        else:
            high = mid - 1
    return low


def _content_kept(prefix: str, cut: int, message: Mapping[str, Any]) -> bool:
    """Whether what ``message`` says (its content, reasoning and the names of the functions it
    calls), the last message of a rendered ``prefix`` that the whole conversation follows only
    up to ``cut``, all comes before the cut: then only the text the template closes the message
    with changed."""
    said = [message["content"], message.get("reasoning_content")]
    said += [(c.get("function") or c).get("name") for c in message.get("tool_calls") or ()]
    for text in said:
        if isinstance(text, str) and text:
            at = prefix.rfind(text)
            if at < 0 or at + len(text) > cut:
                return False
    return True
