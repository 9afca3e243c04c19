"""Datasets, tokenizers, chat templates and batching (arrives with the rl-data issue)."""

from importlib.metadata import version

__version__ = version("rl-data")
