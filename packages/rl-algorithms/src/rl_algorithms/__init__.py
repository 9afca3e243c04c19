"""Training loops and the `rl` command (arrives with the algorithm issues)."""

from importlib.metadata import version

__version__ = version("rl-algorithms")
