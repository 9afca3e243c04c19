"""Work on a thread of its own, its outcome in a future (``start_thread``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def start_thread(name: str, target: Callable[..., Any], *args: Any) -> Future:
    """``target(*args)`` on a daemon thread of its own; the future gets its result or error.
    Nobody joins the thread: one that never returns (an agent program that hangs, an
    environment step that never ends) is left behind, and no later work waits for it, as it
    would for a bounded pool's thread."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(target(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
