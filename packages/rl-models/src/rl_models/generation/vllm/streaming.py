"""``VllmStreamingSampler``: the streams of one vLLM engine, behind ``StreamingSampler``.

The engine is the leader worker of one data-parallel group (``worker.VllmGenerationWorker``,
with ``vllm.async_engine``); the sampler holds a ``RemoteWorker`` of it, so it pickles small and
works from any process (async GRPO's trajectory collector is a Ray actor of its own). It runs in
the caller's environment and imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.remote_worker import RemoteWorker
from rl_models.generation.interfaces import IncompleteRefitError
from rl_models.generation.streaming import StreamNews


class VllmStreamingSampler:
    """``StreamingSampler`` over one engine's leader worker.

    Each call waits at most ``call_timeout`` seconds for the worker (a poll that may wait
    ``timeout`` s for news: that much longer), then raises ``WorkerTimeoutError``.
    """

    def __init__(self, worker: RemoteWorker, call_timeout: float) -> None:
        self.worker = worker
        self.call_timeout = call_timeout
        self.name = worker.name

    def __repr__(self) -> str:
        return f"VllmStreamingSampler({self.name})"

    def start(self, data: BatchedDataDict, greedy: bool = False) -> str:
        return self.worker.call(
            "start_stream",
            timeout=self.call_timeout,
            expected_errors=(IncompleteRefitError,),
            data=data,
            greedy=greedy,
        )

    def poll(self, stream_ids: Sequence[str], timeout: float = 0.0) -> dict[str, StreamNews]:
        return self.worker.call(
            "poll_streams",
            timeout=self.call_timeout + timeout,
            stream_ids=list(stream_ids),
            wait=timeout,
        )

    def cancel(self, stream_id: str) -> int:
        return self.worker.call("cancel_stream", timeout=self.call_timeout, stream_id=stream_id)

    def weight_version(self) -> int:
        return self.worker.call("get_weight_version", timeout=self.call_timeout)
