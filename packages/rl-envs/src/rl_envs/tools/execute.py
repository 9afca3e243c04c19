"""One tool call, as a verifier process runs it (:class:`rl_envs.pool.WorkerPool` with
``run_tool``): the pool's per-call timeout kills the process of a call that hangs, even inside C
code; everything else a tool can do wrong is caught here and reported, never raised.

Light on purpose: verifier processes import it (no torch, no Ray).
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypedDict

from rl_envs.reward_functions import load_reward_function

# ok: the tool returned text within the cap. raised: it raised. bad_return: it returned
# something other than a str. too_long: its text was over the cap (cut there).
CallStatus = Literal["ok", "raised", "bad_return", "too_long"]


class ToolResult(TypedDict):
    status: CallStatus
    output: str  # the text, or what went wrong; never longer than the cap
    seconds: float  # how long the function ran
    length: int  # the length of the text it returned (before the cap)


def prepare_tool(function: str, kwargs: dict[str, Any]) -> None:
    """Call ``function(**kwargs)`` (a built-in tool's ``prepare`` with its config's kwargs) as a
    tool process starts."""
    load_reward_function(function)(**kwargs)


def run_tool(
    function: str, arguments: dict[str, Any], kwargs: dict[str, Any], max_output_chars: int
) -> ToolResult:
    """Call ``function(**arguments, **kwargs)`` (arguments from the model, already checked
    against its schema; kwargs from the config) and judge what it returned. Only up to
    ``max_output_chars`` of any text leave this process: a tool that returns 10 MB costs a
    pipe of the cap, not of its output."""
    tool = load_reward_function(function)
    start = time.perf_counter()
    try:
        value = tool(**arguments, **kwargs)
    except (Exception, SystemExit) as e:  # sys.exit() in a tool is its error, not our exit
        text = f"{type(e).__name__}: {e}"
        return ToolResult(
            status="raised",
            output=text[:max_output_chars],
            seconds=time.perf_counter() - start,
            length=len(text),
        )
    seconds = time.perf_counter() - start
    if not isinstance(value, str):
        # Its type (and size), not its repr: the repr of 10 MB of bytes would be 40 MB.
        try:
            size = f" of length {len(value)}"
        except Exception:
            size = ""
        what = f"{type(value).__name__}{size}"
        return ToolResult(status="bad_return", output=what, seconds=seconds, length=0)
    status: CallStatus = "ok" if len(value) <= max_output_chars else "too_long"
    return ToolResult(
        status=status, output=value[:max_output_chars], seconds=seconds, length=len(value)
    )
