"""Tokenizers: from a local Hugging Face directory, from a GGUF file, or trained on the spot.

Nothing here reaches a model hub: paths must exist on disk, and a missing one is an error that
says so rather than a download attempt.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import model_validator

from rl_data.templates import CHATML_TEMPLATE, ChatTemplateConfig
from rl_distributed.config import ConfigModel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


class TokenizerConfig(ConfigModel):
    """Where the tokenizer comes from and which chat template renders conversations."""

    path: str  # a local directory (tokenizer.json & co.), or the directory holding gguf_file
    gguf_file: str | None = None  # a .gguf file name inside `path` (or an absolute path)
    chat_template: ChatTemplateConfig = ChatTemplateConfig()

    @model_validator(mode="before")
    @classmethod
    def _template_kwargs(cls, data: Any) -> Any:
        """``chat_template_kwargs`` (NeMo RL's key, e.g. ``{enable_thinking: false}``) is
        ``chat_template.kwargs``: the variables the chat template is rendered with."""
        if not isinstance(data, dict) or "chat_template_kwargs" not in data:
            return data
        data = dict(data)
        kwargs = data.pop("chat_template_kwargs") or {}
        template = data.get("chat_template", {})
        if isinstance(template, ChatTemplateConfig):
            template = template.model_dump()
        if not isinstance(kwargs, dict) or not isinstance(template, dict):
            return {**data, "chat_template_kwargs": kwargs}  # pydantic names what is wrong
        given = template.get("kwargs") or {}
        if given and given != kwargs:
            raise ValueError(
                "give chat_template_kwargs or chat_template.kwargs, not both (they are one key)"
            )
        data["chat_template"] = {**template, "kwargs": kwargs}
        return data


def load_tokenizer(cfg: TokenizerConfig) -> PreTrainedTokenizerBase:
    """The tokenizer ``cfg`` names, with a pad token (the EOS token when it has none)."""
    from transformers import AutoTokenizer  # costs seconds: only when a tokenizer is needed

    path, kwargs = tokenizer_files(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
    return with_pad_token(tokenizer)


def tokenizer_files(cfg: TokenizerConfig) -> tuple[Path, dict[str, Any]]:
    """The directory the tokenizer is read from and the keyword arguments to read it with;
    a ``FileNotFoundError`` naming the missing directory or GGUF file (cheap: checks before a
    run call it too)."""
    path = Path(cfg.path)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if cfg.gguf_file is not None:
        gguf = Path(cfg.gguf_file)
        if gguf.is_absolute():
            path, gguf = gguf.parent, Path(gguf.name)
        if not (path / gguf).is_file():
            raise FileNotFoundError(f"GGUF file not found: {path / gguf}")
        kwargs["gguf_file"] = str(gguf)
    elif not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory not found: {path} (tokenizers are only read from local "
            "directories or GGUF files; there is no model hub access)"
        )
    return path, kwargs


def with_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Padding positions are masked out, so any token will do; EOS is the usual choice."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad token nor an EOS token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 500,
    chat_template: str = CHATML_TEMPLATE,
    split_pattern: str | None = None,
) -> PreTrainedTokenizerBase:
    """A small byte-level BPE tokenizer trained on ``texts``, with ChatML special tokens.

    For tests and examples: it behaves like a pretrained one (special tokens, chat template,
    ``save_pretrained``) and takes a fraction of a second to build. ``split_pattern`` is the
    regular expression that cuts text into the pieces BPE merges within (a model's
    tokenizer.json has it, e.g. Llama 3's and Qwen2's, which keep a line end with the
    punctuation before it); None: GPT-2's, as SmolLM2 uses.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False)
        if split_pattern is None
        else pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="<|endoftext|>",
        chat_template=chat_template,
    )


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, with no special tokens added (templates write their own).

    Fast tokenizers encode the whole list in one call into the Rust backend, which is what
    makes tokenising message by message cost no more than tokenising whole conversations.
    A text that comes up again (a shared system prompt, a template's fixed turn) is encoded
    once: repeats within the call share one encoding, and recent texts are remembered per
    tokenizer (:class:`_RecentTexts`). Encoding is deterministic, so the ids are the same.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # a backend configured to pad or truncate would change the ids: let transformers handle it
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    # tokens added since (add_tokens, add_special_tokens) change the ids: forget the old ones
    recent = _recent_texts(tokenizer, backend.get_vocab_size(with_added_tokens=True))
    known: dict[str, list[int]] = {}
    todo: list[str] = []
    for text in texts:
        if text in known:
            continue
        ids = recent.get(text)
        if ids is None:
            known[text] = []  # placeholder: encoded below
            todo.append(text)
        else:
            known[text] = ids
    if todo:
        # encode_batch_fast skips the character offsets nobody here reads: the same ids, faster
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        for text, encoding in zip(todo, encode(todo, add_special_tokens=False), strict=True):
            known[text] = encoding.ids
            recent.put(text, encoding.ids)
    return [known[text] for text in texts]


class _RecentTexts:
    """Ids of recently encoded short texts, oldest forgotten first (bounded memory)."""

    MAX_ENTRIES = 4096
    MAX_CHARS = 4096  # long texts rarely repeat: not worth keeping

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._ids: OrderedDict[str, list[int]] = OrderedDict()

    def get(self, text: str) -> list[int] | None:
        ids = self._ids.get(text)
        if ids is not None:
            self._ids.move_to_end(text)
        return ids

    def put(self, text: str, ids: list[int]) -> None:
        if len(text) > self.MAX_CHARS:
            return
        self._ids[text] = ids
        if len(self._ids) > self.MAX_ENTRIES:
            self._ids.popitem(last=False)


_RECENT: weakref.WeakKeyDictionary[Any, _RecentTexts] = weakref.WeakKeyDictionary()


def _recent_texts(tokenizer: Any, vocab_size: int) -> _RecentTexts:
    # keyed by the tokenizer object and its vocabulary size: they decide the ids
    try:
        recent = _RECENT.get(tokenizer)
        if recent is None or recent.vocab_size != vocab_size:
            recent = _RECENT[tokenizer] = _RecentTexts(vocab_size)
        return recent
    except TypeError:  # an object that cannot be weakly referenced: no memory across calls
        return _RecentTexts(vocab_size)


def check_same_vocabulary(
    student: PreTrainedTokenizerBase,
    teacher: PreTrainedTokenizerBase,
    student_name: str,
    teacher_name: str,
) -> None:
    """Refuse two tokenizers whose token ids mean different strings: a teacher's log-probs of
    the student's token ids would then score other text. Names the first differing token."""
    a, b = student.get_vocab(), teacher.get_vocab()
    by_id_a = {i: t for t, i in a.items()}
    by_id_b = {i: t for t, i in b.items()}
    for i in sorted(set(by_id_a) | set(by_id_b)):
        if by_id_a.get(i) != by_id_b.get(i):
            raise ValueError(
                f"the student's tokenizer ({student_name}, {len(a)} tokens) and the teacher's "
                f"({teacher_name}, {len(b)} tokens) differ: token id {i} is "
                f"{by_id_a.get(i)!r} for the student and {by_id_b.get(i)!r} for the teacher. "
                "Distillation compares log-probs token by token, so both must share one "
                "vocabulary"
            )
