"""The calculator agent of examples/agent_programs, with every reply the endpoint sent it kept
(``replies``): what tests/test_agent_programs_example.py compares the trained tokens with."""

import importlib.util
from pathlib import Path

import openai.resources.chat.completions as chat

EXAMPLE = (
    Path(__file__).resolve().parents[1] / "examples" / "agent_programs" / "calculator_agent.py"
)
spec = importlib.util.spec_from_file_location("calculator_agent", EXAMPLE)
calculator_agent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calculator_agent)

replies: list = []
_create = chat.Completions.create


def _recorded_create(self, *args, **kwargs):
    reply = _create(self, *args, **kwargs)
    replies.append(reply)
    return reply


chat.Completions.create = _recorded_create


def agent(base_url: str, row: dict) -> str:
    return calculator_agent.agent(base_url, row)
