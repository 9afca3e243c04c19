"""The verifier process a :class:`~rl_envs.pool.VerifierWorker` talks to over a pipe.

Run as ``python -m rl_envs._child MODULE...``: imports the modules (so the first sample does not
pay for them; a ``module:function`` or ``file.py:function`` reference is loaded as a reward
function, under the start-up timeout rather than a sample's), then answers ``(function path, args)`` frames with ``("ok", value)`` or
``("error", text)`` until its stdin closes. It runs in its own process so that a verifier that
hangs (even inside C code, where no signal handler runs) can be killed without harming anyone.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import signal
import struct
import sys
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

HEADER = struct.Struct("<Q")
PR_SET_PDEATHSIG = 1


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError
    (size,) = HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError(f"truncated frame: {len(data)} of {size} bytes")
    return pickle.loads(data)


def resolve(path: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    # Die with the worker that started us, even while stuck in a verifier: we are in our own
    # session (so that a timeout can kill our group), which Ray's cleanup does not reach.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the worker died before the line above ran
        return
    # The protocol owns the real stdout; a verifier's own prints go to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    for name in sys.argv[1:]:
        if ":" in name:  # a function reference (a user's reward file): loaded and cached
            from rl_envs.reward_functions import load_reward_function

            load_reward_function(name)
        else:
            importlib.import_module(name)
    write_frame(out, ("ready", None))
    functions: dict[str, Callable[..., Any]] = {}
    while True:
        try:
            path, args = read_frame(inp)
        except EOFError:
            return
        try:
            if path not in functions:
                functions[path] = resolve(path)
            reply = ("ok", functions[path](*args))
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
        try:
            write_frame(out, reply)
        except Exception as e:  # an unpicklable result is the verifier's fault, not ours
            write_frame(out, ("error", f"result could not be sent: {e!r}"))


if __name__ == "__main__":
    main()
