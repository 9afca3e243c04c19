"""Reward environments: turn generated text into rewards and, in multi-turn tasks, into the next
observation. Each runs as a Ray actor; verifiers run in a pool of worker actors, each sample
under a timeout, so that a verifier that throws or hangs costs a reward, never the run.

Names are imported on first use: verifier processes import ``rl_envs.verifiers`` and must not
pay for torch and Ray.
"""

from importlib import import_module
from importlib.metadata import version
from typing import Any

__version__ = version("rl-envs")

_WHERE = {
    "CallCase": "rl_envs.code.cases",
    "CodeEnvConfig": "rl_envs.code.env",
    "CodeEnvironment": "rl_envs.code.env",
    "EnvironmentInterface": "rl_envs.interfaces",
    "EnvironmentReturn": "rl_envs.interfaces",
    "EnvironmentStep": "rl_envs.interfaces",
    "HttpRewardEnvConfig": "rl_envs.http_reward_env",
    "HttpRewardEnvironment": "rl_envs.http_reward_env",
    "MathEnvConfig": "rl_envs.math_env",
    "MathEnvironment": "rl_envs.math_env",
    "Outcome": "rl_envs.pool",
    "OutcomeCounts": "rl_envs.metrics",
    "ReasoningGymEnvConfig": "rl_envs.reasoning_gym_env",
    "ReasoningGymEnvironment": "rl_envs.reasoning_gym_env",
    "RewardComponents": "rl_envs.interfaces",
    "RewardServerError": "rl_envs.http_reward_env",
    "RewardFunctionSpec": "rl_envs.reward_function_env",
    "RewardFunctionsEnvConfig": "rl_envs.reward_function_env",
    "RewardFunctionsEnvironment": "rl_envs.reward_function_env",
    "RewardModelEnvConfig": "rl_envs.reward_model_env",
    "RewardModelEnvironment": "rl_envs.reward_model_env",
    "SandboxLimits": "rl_envs.code.sandbox",
    "ScoreInTag": "rl_envs.judging",
    "SandboxResult": "rl_envs.code.sandbox",
    "SandboxUnavailableError": "rl_envs.code.sandbox",
    "SlidingPuzzleConfig": "rl_envs.sliding_puzzle",
    "SlidingPuzzleEnvironment": "rl_envs.sliding_puzzle",
    "StdioCase": "rl_envs.code.cases",
    "ToolEnvConfig": "rl_envs.tools.env",
    "ToolEnvironment": "rl_envs.tools.env",
    "ToolSpec": "rl_envs.tools.registry",
    "VerifierEnvConfig": "rl_envs.verifier_env",
    "VerifierEnvironment": "rl_envs.verifier_env",
    "YesProbability": "rl_envs.judging",
    "WorkerPool": "rl_envs.pool",
    "call_cases_from_asserts": "rl_envs.code.cases",
    "last_assistant_text": "rl_envs.interfaces",
    "parse_tool_calls": "rl_envs.tools.parsers",
    "pass_at_k": "rl_envs.metrics",
    "render_rubric": "rl_envs.judging",
    "reward_metrics": "rl_envs.metrics",
    "run_code": "rl_envs.code.sandbox",
    "load_reward_function": "rl_envs.reward_functions",
    "score_code": "rl_envs.verifiers",
    "score_math": "rl_envs.verifiers",
    "score_reasoning_gym": "rl_envs.verifiers",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rl_envs' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return [*globals(), *__all__]
