"""Datasets, tokenizers, chat templates and batching: everything a training run reads.

The path of a sample::

    rows = load_dataset(ChatFileConfig(path="train.jsonl"))      # read and checked
    tokenizer = load_tokenizer(TokenizerConfig(path="model/"))   # local files only
    template = ChatTemplate.from_config(ChatTemplateConfig(), tokenizer)
    data = ProcessedDataset(rows, tokenizer, template, "sft", max_seq_length=2048)
    loader = StatefulDataLoader(data, 32, partial(sft_collate, pad_token_id=tokenizer.pad_token_id))

Heavy libraries (transformers, datasets, reasoning-gym) load only when first used.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("rl-data")
except PackageNotFoundError:  # on sys.path (PYTHONPATH=.../src), not installed: bench/gpu_check.py
    __version__ = "0+linked"

_EXPORTS = {
    "DataError": "rl_data.errors",
    "SkippedRow": "rl_data.errors",
    "TemplateError": "rl_data.errors",
    "ChatTemplate": "rl_data.templates",
    "ChatTemplateConfig": "rl_data.templates",
    "TokenizerConfig": "rl_data.tokenizers",
    "build_tokenizer": "rl_data.tokenizers",
    "load_tokenizer": "rl_data.tokenizers",
    "check_messages": "rl_data.messages",
    "check_tools": "rl_data.messages",
    "tokenize_message_logs": "rl_data.messages",
    "ArithmeticConfig": "rl_data.datasets",
    "ChatFileConfig": "rl_data.datasets",
    "DataConfig": "rl_data.datasets",
    "PreferenceFileConfig": "rl_data.datasets",
    "ReasoningGymConfig": "rl_data.datasets",
    "RowDataset": "rl_data.datasets",
    "load_dataset": "rl_data.datasets",
    "load_splits": "rl_data.datasets",
    "register_source": "rl_data.datasets",
    "require_env_info": "rl_data.datasets",
    "PROCESSORS": "rl_data.processors",
    "ProcessedDataset": "rl_data.processors",
    "get_processor": "rl_data.processors",
    "register_processor": "rl_data.processors",
    "TrainBatch": "rl_data.batch",
    "flatten_message_logs": "rl_data.collate",
    "preference_collate": "rl_data.collate",
    "rl_collate": "rl_data.collate",
    "sft_collate": "rl_data.collate",
    "StatefulDataLoader": "rl_data.loader",
    "DatumSpec": "rl_data.types",
    "Message": "rl_data.types",
    "MessageLog": "rl_data.types",
    "PreferenceDatumSpec": "rl_data.types",
    "TaskDataSpec": "rl_data.types",
}

__all__ = [
    "PROCESSORS",
    "ArithmeticConfig",
    "ChatFileConfig",
    "ChatTemplate",
    "ChatTemplateConfig",
    "DataConfig",
    "DataError",
    "DatumSpec",
    "Message",
    "MessageLog",
    "PreferenceDatumSpec",
    "PreferenceFileConfig",
    "ProcessedDataset",
    "ReasoningGymConfig",
    "RowDataset",
    "SkippedRow",
    "StatefulDataLoader",
    "TaskDataSpec",
    "TemplateError",
    "TokenizerConfig",
    "TrainBatch",
    "__version__",
    "build_tokenizer",
    "check_messages",
    "check_tools",
    "flatten_message_logs",
    "get_processor",
    "load_dataset",
    "load_splits",
    "load_tokenizer",
    "preference_collate",
    "register_processor",
    "register_source",
    "require_env_info",
    "rl_collate",
    "sft_collate",
    "tokenize_message_logs",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rl_data' has no attribute {name!r}")


if TYPE_CHECKING:
    from rl_data.batch import TrainBatch
    from rl_data.collate import flatten_message_logs, preference_collate, rl_collate, sft_collate
    from rl_data.datasets import (
        ArithmeticConfig,
        ChatFileConfig,
        DataConfig,
        PreferenceFileConfig,
        ReasoningGymConfig,
        RowDataset,
        load_dataset,
        load_splits,
        register_source,
        require_env_info,
    )
    from rl_data.errors import DataError, SkippedRow, TemplateError
    from rl_data.loader import StatefulDataLoader
    from rl_data.messages import check_messages, check_tools, tokenize_message_logs
    from rl_data.processors import (
        PROCESSORS,
        ProcessedDataset,
        get_processor,
        register_processor,
    )
    from rl_data.templates import ChatTemplate, ChatTemplateConfig
    from rl_data.tokenizers import TokenizerConfig, build_tokenizer, load_tokenizer
    from rl_data.types import DatumSpec, Message, MessageLog, PreferenceDatumSpec, TaskDataSpec
