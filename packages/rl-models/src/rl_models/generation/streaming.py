"""Streaming generation: start a batch on an engine, collect its samples as each one finishes,
cancel what is no longer wanted.

Async GRPO's trajectory collector keeps the engines busy with many small streams (the G
samples of one prompt each) and scores a group as soon as its last sample is out. It sees an
engine only through ``StreamingSampler``: typed calls, typed errors, nothing of Ray.

Errors a caller handles, each caught with ``isinstance``:

- ``IncompleteRefitError`` from ``start``: a refit is loading weights; start again soon;
- ``StreamNews.aborted`` (a ``RequestAbortedError``): the engine aborted a request of the
  stream on its own; the stream is over and its other requests cancelled;
- ``rl_distributed.WorkerTimeoutError``: the engine did not answer within the sampler's
  deadline (wedged or overloaded); ``rl_distributed.WorkerDiedError``: its worker died;
  ``rl_distributed.WorkerCallError``: anything else the engine raised. Each names the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.interfaces import RequestAbortedError


@dataclass
class StreamNews:
    """What one poll found for one stream."""

    # Row of the stream's batch -> that row's result (``generate``'s keys, one row, plus
    # ``weight_version_min`` / ``weight_version_max``: the oldest and newest weight versions
    # that produced its tokens, which differ when a refit landed while it was sampled).
    samples: dict[int, BatchedDataDict]
    done: bool  # every row has been handed out; the engine has forgotten the stream
    # The engine aborted a request of this stream without a cancel: the stream is over (its
    # other requests are cancelled) and will never be done.
    aborted: RequestAbortedError | None = None


@runtime_checkable
class StreamingSampler(Protocol):
    """One generation engine's streams, callable from any process (it pickles small)."""

    name: str  # the engine's worker, as error messages name it

    def start(self, data: BatchedDataDict, greedy: bool = False) -> str:
        """Submit every row of ``data`` (``generate``'s input keys); returns the stream's id.
        All rows are submitted or none is."""
        ...

    def poll(self, stream_ids: Sequence[str], timeout: float = 0.0) -> dict[str, StreamNews]:
        """News of the given streams, only those that have some; waits up to ``timeout``
        seconds for the first news when there is none yet."""
        ...

    def cancel(self, stream_id: str) -> int:
        """Abort the stream's unfinished requests and forget it; how many were aborted."""
        ...

    def weight_version(self) -> int:
        """The weight version the engine holds now."""
        ...


@runtime_checkable
class StreamingGeneration(Protocol):
    """A generator whose engines stream (``GenerationInterface`` implementations may offer it)."""

    def streaming_samplers(self, call_timeout: float) -> list[StreamingSampler]:
        """One sampler per data-parallel engine; each call waits at most ``call_timeout`` s."""
        ...
