"""Reward environments (arrives with the rl-envs issue)."""

from importlib.metadata import version

__version__ = version("rl-envs")
