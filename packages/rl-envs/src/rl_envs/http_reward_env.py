"""Rewards from a reward server someone already runs (``env.<task>.kind: http``)::

    env:
      qa:
        kind: http
        config:
          url: http://reward-host:8000/score
          timeout_s: 30          # per request
          max_attempts: 4        # tries per request, waiting backoff_s, 2 * backoff_s, ... between
          on_failure: fail       # or "drop": unscored samples are counted, not trained on

Each ``step`` posts its samples (in requests of at most ``batch_size``) as JSON::

    {"items": [{"prompt": ..., "completion": "...", "columns": {...}}, ...]}

``prompt`` as reward functions get it (the dataset's string, or the conversation before the
answer as ``{"role", "content"}`` messages), ``completion`` the answer's text, ``columns`` the
row's other columns (``ground_truth``, say). The server answers ``{"scores": [s0, s1, ...]}``,
one finite number per item, in order.

What can go wrong, and what happens then:

- A request that times out, cannot connect, has its connection closed, or is answered 5xx,
  408 or 429 is tried again after a wait that doubles each time (``backoff_s``), up to
  ``max_attempts`` tries in all. When the last one fails too, the samples of that request have
  no score: with ``on_failure: fail`` (the default) the step raises a ``RewardServerError``
  naming the URL and the last failure (its HTTP status, or the timeout, or the broken
  connection); with ``on_failure: drop`` their step is marked ``unscored`` (reward 0, left
  out of the loss by the rollout: end reason ``unscored``), their observation says they were
  not scored, and they are counted (``timeouts`` and ``verifier_errors`` among ``samples``).
- Any other answer is the server (or this config) being wrong, which no retry mends, so the
  step raises whatever ``on_failure`` says, naming the URL and, where there is one, the item:
  another 4xx status (401, 404, 422...), a body that is not ``{"scores": [...]}``, a wrong
  number of scores, or a score that is not a finite number.

The default is ``fail``: a server that stops answering stops the run rather than quietly
thinning its batches. With ``drop`` the run goes on without those samples; their 0 still sits
in their GRPO group's mean (as a timed-out environment step's does), so watch
``verifier_errors``.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import torch
from pydantic import Field, field_validator

from rl_data.types import MessageLog
from rl_distributed.config import ConfigModel
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn
from rl_envs.metrics import OutcomeCounts, reward_metrics
from rl_envs.reward_function_env import prompt_and_completion, row_columns

logger = logging.getLogger(__name__)

#: Statuses worth another try: the server is busy or briefly down, or timed the request out.
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: The longest wait between two tries, whatever ``backoff_s`` doubles to.
MAX_BACKOFF_S = 60.0


class RewardServerError(RuntimeError):
    """The reward server gave no usable scores (see the module docstring for when)."""


class HttpRewardEnvConfig(ConfigModel):
    # The endpoint the batches are posted to (http:// or https://).
    url: str
    # Sent with every request (an Authorization header, say).
    headers: dict[str, str] = Field(default_factory=dict)
    # Seconds one request may take (connecting, sending, the server's work, reading).
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    # Tries per request, the first included; failures that a retry cannot mend are not retried.
    max_attempts: int = Field(4, ge=1)
    # The wait before the second try; it doubles before each further one (at most 60 s).
    backoff_s: float = Field(0.5, ge=0, allow_inf_nan=False)
    # Items per request; None: a step's whole batch in one request.
    batch_size: int | None = Field(None, ge=1)
    # Requests of one step in flight at once.
    max_concurrent_requests: int = Field(4, ge=1)
    # What a request whose every try failed costs: "fail" stops the step (and the run);
    # "drop" marks its samples unscored: counted, and left out of the loss.
    on_failure: Literal["fail", "drop"] = "fail"
    # The k of the pass@k metrics reported at validation.
    pass_at_k: list[int] = [1]
    success_threshold: float = 1.0  # reward at which a sample counts as correct
    # Where this config sits in the recipe, for error messages (set by the recipe's loader).
    config_key: str = "http"

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is no http:// or https:// URL")
        return url


@dataclass(frozen=True)
class _Failure:
    """Why a request gave no scores after its tries: ``status`` as ``OutcomeCounts`` counts it
    (``timeout`` or ``error``) and what happened, for the error message."""

    status: Literal["timeout", "error"]
    reason: str


class HttpRewardEnvironment(EnvironmentInterface):
    """Single-turn: one score per completion from the reward server at ``cfg.url``. Metadata
    per sample: the row's columns, sent along with it.

    ``step`` is safe to call from several threads (its counts under a lock, the requests
    outside it)."""

    def __init__(self, cfg: HttpRewardEnvConfig) -> None:
        self.cfg = cfg
        self.counts = OutcomeCounts()
        self.retries = 0  # requests tried again, since the last metrics call
        self._lock = threading.Lock()
        # One client for the actor's life: its connections are kept and reused across steps.
        self._client = httpx.Client(headers=cfg.headers, timeout=cfg.timeout_s)

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        n = len(message_log_batch)
        items = []
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True)):
            prompt, completion, _ = prompt_and_completion(log, meta)
            items.append(self._item(i, prompt, completion, row_columns(meta)))
        size = self.cfg.batch_size or max(n, 1)
        starts = list(range(0, n, size))
        with ThreadPoolExecutor(
            max_workers=max(1, min(len(starts), self.cfg.max_concurrent_requests))
        ) as pool:
            answers = list(pool.map(lambda s: self._scores(items[s : s + size], s), starts))
        scores: list[float | None] = []
        failures: list[_Failure | None] = []
        for start, answer in zip(starts, answers, strict=True):
            count = min(size, n - start)
            if isinstance(answer, _Failure):
                scores += [None] * count
                failures += [answer] * count
            else:
                scores += answer
                failures += [None] * count
        with self._lock:
            for failure in failures:
                self.counts.add("ok" if failure is None else failure.status)
        first = next((f for f in failures if f is not None), None)
        if first is not None:
            unscored = sum(f is not None for f in failures)
            logger.warning(
                "reward server %s gave no scores for %d of %d samples; they are left out of "
                "the loss (%s.on_failure: drop): %s",
                self.cfg.url,
                unscored,
                n,
                self.cfg.config_key,
                first.reason,
            )
        rewards = [0.0 if s is None else s for s in scores]
        return EnvironmentReturn(
            observations=[
                {
                    "role": "environment",
                    "content": f"reward {r:g}" if f is None else f"not scored: {f.status}",
                }
                for r, f in zip(rewards, failures, strict=True)
            ],
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=[None] * n,
            unscored=torch.tensor([f is not None for f in failures], dtype=torch.bool),
        )

    def _item(self, i: int, prompt: Any, completion: str, columns: dict[str, Any]) -> dict:
        """Sample ``i``'s item of the request, checked to be JSON here, where the column that
        is not can still be named."""
        for name, value in columns.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"{self.cfg.config_key}: sample {i}'s column {name!r} cannot be sent to "
                    f"{self.cfg.url} as JSON ({type(value).__name__}: {e})"
                ) from None
        return {"prompt": prompt, "completion": completion, "columns": columns}

    def _scores(self, items: list[dict], start: int) -> list[float] | _Failure:
        """The server's scores for ``items`` (the batch's from ``start`` on), after as many
        tries as it takes and ``max_attempts`` allows; a ``_Failure`` when every try failed and
        ``on_failure`` is ``drop``. Everything else that goes wrong raises."""
        where = f"items {start}..{start + len(items) - 1} of the batch"
        failure = _Failure("error", "never tried")
        for attempt in range(self.cfg.max_attempts):
            if attempt:
                with self._lock:
                    self.retries += 1
                time.sleep(min(self.cfg.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                response = self._post(items)
            except httpx.TimeoutException:
                failure = _Failure("timeout", f"timed out after {self.cfg.timeout_s:g}s")
                continue
            except httpx.TransportError as e:  # refused, reset, closed without an answer
                failure = _Failure("error", f"no answer ({type(e).__name__}: {e})")
                continue
            if response.status_code in RETRIED_STATUSES:
                failure = _Failure("error", f"HTTP {response.status_code}: {_excerpt(response)}")
                continue
            if response.status_code != 200:
                raise RewardServerError(
                    f"{self._where()} answered HTTP {response.status_code} for {where}, which "
                    f"a retry cannot mend: {_excerpt(response)}"
                )
            return self._parse(response, start, len(items))
        if self.cfg.on_failure == "drop":
            return failure
        raise RewardServerError(
            f"{self._where()} failed {self.cfg.max_attempts} times for {where}; the last: "
            f"{failure.reason} (on_failure: drop would leave those samples out instead)"
        )

    def _post(self, items: list[dict]) -> httpx.Response:
        """One request, cut once it has taken ``timeout_s`` in all. (httpx's own timeout bounds
        each phase on its own: the connect, each read; a server that trickles its answer out a
        few bytes at a time would never be cut by it.)"""
        deadline = time.monotonic() + self.cfg.timeout_s
        with self._client.stream("POST", self.cfg.url, json={"items": items}) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the answer took longer than timeout_s in all")
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            content=bytes(body),
            request=response.request,
        )

    def _parse(self, response: httpx.Response, start: int, count: int) -> list[float]:
        """The ``count`` scores of a 200 answer, checked."""
        try:
            scores = response.json()["scores"]
        except (ValueError, KeyError, TypeError):
            scores = None
        if not isinstance(scores, list):
            raise RewardServerError(
                f"{self._where()} answered {_excerpt(response)}; expected a JSON object "
                '{"scores": [one number per item]}'
            )
        if len(scores) != count:
            raise RewardServerError(
                f"{self._where()} returned {len(scores)} scores for {count} items (items "
                f"{start}..{start + count - 1} of the batch); expected one per item, in order"
            )
        out = []
        for i, score in enumerate(scores):
            if isinstance(score, bool) or not isinstance(score, numbers.Real) or not _finite(score):
                raise RewardServerError(
                    f"{self._where()} returned {score!r:.80} as the score of item {start + i} of "
                    "the batch; expected a finite number"
                )
            out.append(float(score))
        return out

    def _where(self) -> str:
        return f"{self.cfg.config_key}: the reward server {self.cfg.url}"

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        metrics = reward_metrics(
            batch["rewards"],
            batch.get("group_ids"),
            ks=self.cfg.pass_at_k,
            success_threshold=self.cfg.success_threshold,
        )
        with self._lock:
            counts = {**self.counts.take(), "retries": float(self.retries)}
            self.retries = 0
        return batch, {**metrics, **counts}

    def shutdown(self) -> None:
        self._client.close()


def _finite(score: numbers.Real) -> bool:
    """A finite float: JSON integers have no size limit, and one past a float's range is no
    score either (``math.isfinite`` would raise ``OverflowError`` on it)."""
    try:
        return math.isfinite(float(score))
    except OverflowError:
        return False


def _excerpt(response: httpx.Response) -> str:
    """The start of a response's body, for an error message."""
    return repr(response.text[:200])
