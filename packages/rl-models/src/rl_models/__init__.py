"""Policy and generation backends (arrives with the rl-models issue)."""

from importlib.metadata import version

__version__ = version("rl-models")
