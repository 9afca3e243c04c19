"""``kind: http`` against real local servers: a FastAPI app under uvicorn (in a thread, on a
free port) that scores, is slow, answers 500 or 404, returns the wrong number of scores or a
non-number; and a bare socket server that closes each connection without answering. Each
misbehaviour gives the outcome the module docstring documents."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import socketserver
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rl_data.types import STRING_PROMPT_KEY
from rl_envs.http_reward_env import HttpRewardEnvConfig, HttpRewardEnvironment, RewardServerError


class RewardServer:
    """The reference reward server: ``POST /score`` scores 1.0 for a completion holding the
    row's ``ground_truth``, else 0.0; the other routes misbehave. Every request's body and
    time are kept per route."""

    def __init__(self) -> None:
        self.requests: dict[str, list[dict]] = defaultdict(list)
        self.times: dict[str, list[float]] = defaultdict(list)
        app = FastAPI()

        def scores(body: dict) -> list[float]:
            return [
                float(item["columns"]["ground_truth"] in item["completion"])
                for item in body["items"]
            ]

        @app.post("/trickle")
        async def trickle(request: Request) -> StreamingResponse:
            """The answer a byte at a time, each well within a read timeout, 2 s in all."""
            body = json.dumps({"scores": scores(await request.json())}).encode()
            self.requests["trickle"].append({})

            async def chunks():
                for i in range(len(body)):
                    await asyncio.sleep(2.0 / len(body))
                    yield body[i : i + 1]

            return StreamingResponse(chunks(), media_type="application/json")

        @app.post("/{route}")
        async def score(route: str, request: Request) -> JSONResponse:
            body = await request.json()
            self.requests[route].append(body)
            self.times[route].append(time.monotonic())
            tries = len(self.requests[route])
            if route == "slow" or (route == "slow-once" and tries == 1):
                await asyncio.sleep(1.0)
            if route == "500" or (route == "503-twice" and tries <= 2):
                status = 500 if route == "500" else 503
                return JSONResponse({"detail": "overloaded"}, status_code=status)
            if route == "404":
                return JSONResponse({"detail": "not found"}, status_code=404)
            if route == "wrong-count":
                return JSONResponse({"scores": scores(body)[:-1]})
            if route == "non-number":
                return JSONResponse({"scores": [*scores(body)[:-1], "high"]})
            if route == "huge-int":
                return JSONResponse({"scores": [*scores(body)[:-1], 10**400]})
            if route == "no-scores":
                return JSONResponse({"rewards": scores(body)})
            return JSONResponse({"scores": scores(body)})

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no server"
            time.sleep(0.01)

    def reset(self) -> None:
        self.requests.clear()
        self.times.clear()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class _HangUp(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.recv(65536)  # the request, read and left unanswered
        self.server.connections += 1  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def server():
    server = RewardServer()
    yield server
    server.close()


@pytest.fixture
def reward_server(server):
    server.reset()
    return server


@pytest.fixture(scope="module")
def hang_up_url():
    """A server that accepts each connection, reads the request and closes it unanswered."""
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _HangUp) as tcp:
        tcp.connections = 0  # type: ignore[attr-defined]
        thread = threading.Thread(target=tcp.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{tcp.server_address[1]}/score", tcp
        tcp.shutdown()


def _env(url: str, **config) -> HttpRewardEnvironment:
    config = {"backoff_s": 0.01, "timeout_s": 5.0, "config_key": "env.qa.config", **config}
    return HttpRewardEnvironment(HttpRewardEnvConfig(url=url, **config))


COMPLETIONS = ["it is 12", "13", "twelve", "12!", "no"]


def _batch(n: int = 5):
    logs = [
        [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": c}]
        for i, c in enumerate(COMPLETIONS[:n])
    ]
    metadata = [{"ground_truth": "12", "row": i} for i in range(n)]
    return logs, metadata


def test_scores_come_back_in_order_over_several_requests(reward_server):
    env = _env(f"{reward_server.url}/score", batch_size=2)
    logs, metadata = _batch()
    metadata[1][STRING_PROMPT_KEY] = "the dataset's own prompt"
    out = env.step(logs, metadata)
    expected = [float("12" in c) for c in COMPLETIONS]
    assert out.rewards.tolist() == expected
    assert out.terminateds.all()
    # 5 items in requests of 2: three requests, each sample sent as documented. The requests
    # are in flight together, so the server may see them in any order.
    items = [item for body in reward_server.requests["score"] for item in body["items"]]
    rows = [
        tuple(item["columns"]["row"] for item in body["items"])
        for body in reward_server.requests["score"]
    ]
    assert sorted(rows) == [(0, 1), (2, 3), (4,)]
    assert sorted(item["columns"]["row"] for item in items) == list(range(5))
    first = next(item for item in items if item["columns"]["row"] == 0)
    assert first == {
        "prompt": [{"role": "user", "content": "question 0"}],
        "completion": "it is 12",
        "columns": {"ground_truth": "12", "row": 0},
    }
    second = next(item for item in items if item["columns"]["row"] == 1)
    assert second["prompt"] == "the dataset's own prompt"
    assert STRING_PROMPT_KEY not in second["columns"]
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
    assert metrics["samples"] == 5 and metrics["timeouts"] == metrics["verifier_errors"] == 0
    assert metrics["reward_mean"] == pytest.approx(sum(expected) / 5)
    env.shutdown()


def test_a_server_slower_than_the_timeout_fails_the_step_naming_url_and_timeout(reward_server):
    url = f"{reward_server.url}/slow"
    env = _env(url, timeout_s=0.3, max_attempts=2)
    with pytest.raises(RewardServerError, match=rf"{url} failed 2 times .*timed out after 0.3s"):
        env.step(*_batch(2))
    assert len(reward_server.requests["slow"]) == 2


def test_a_slow_server_under_on_failure_drop_gives_counted_unscored_samples(reward_server):
    env = _env(f"{reward_server.url}/slow", timeout_s=0.3, max_attempts=2, on_failure="drop")
    out = env.step(*_batch(3))
    assert out.rewards.tolist() == [0.0, 0.0, 0.0]
    assert [step.unscored for step in out.steps()] == [True, True, True]
    assert [o["content"] for o in out.observations] == ["not scored: timeout"] * 3
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
    assert (metrics["samples"], metrics["timeouts"], metrics["retries"]) == (3, 3, 1)


def test_one_slow_answer_is_retried_and_scored(reward_server):
    env = _env(f"{reward_server.url}/slow-once", timeout_s=0.5, max_attempts=2)
    out = env.step(*_batch(3))
    assert out.rewards.tolist() == [1.0, 0.0, 0.0]
    assert out.unscored is not None and not out.unscored.any()
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
    assert (metrics["timeouts"], metrics["retries"]) == (0, 1)


def test_500_is_retried_with_doubling_waits_then_names_url_and_status(reward_server):
    url = f"{reward_server.url}/500"
    env = _env(url, max_attempts=3, backoff_s=0.1)
    with pytest.raises(RewardServerError, match=rf"{url} failed 3 times .*HTTP 500"):
        env.step(*_batch(2))
    times = reward_server.times["500"]
    assert len(times) == 3
    assert times[1] - times[0] >= 0.1 and times[2] - times[1] >= 0.2


def test_500_under_on_failure_drop_counts_the_samples_as_errors(reward_server):
    env = _env(f"{reward_server.url}/500", max_attempts=2, on_failure="drop", batch_size=2)
    out = env.step(*_batch(3))
    assert out.rewards.tolist() == [0.0, 0.0, 0.0]
    assert out.unscored is not None and out.unscored.tolist() == [True, True, True]
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
    assert (metrics["samples"], metrics["verifier_errors"], metrics["timeouts"]) == (3, 3, 0)


def test_a_server_that_recovers_within_the_attempts_scores(reward_server):
    env = _env(f"{reward_server.url}/503-twice", max_attempts=3)
    assert env.step(*_batch(2)).rewards.tolist() == [1.0, 0.0]
    assert len(reward_server.requests["503-twice"]) == 3


@pytest.mark.parametrize("on_failure", ["fail", "drop"])
def test_a_wrong_number_of_scores_is_an_error_without_retry(reward_server, on_failure):
    url = f"{reward_server.url}/wrong-count"
    env = _env(url, on_failure=on_failure)
    with pytest.raises(RewardServerError, match=rf"{url} returned 2 scores for 3 items"):
        env.step(*_batch(3))
    assert len(reward_server.requests["wrong-count"]) == 1


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ("non-number", r"returned 'high' as the score of item 2 of the batch"),
        ("no-scores", r"answered .*rewards.*; expected a JSON object"),
        ("404", r"answered HTTP 404 .*a retry cannot mend"),
    ],
)
def test_answers_no_retry_mends_fail_naming_url_and_item(reward_server, route, message):
    url = f"{reward_server.url}/{route}"
    with pytest.raises(RewardServerError, match=rf"{url}.*{message}"):
        _env(url, on_failure="drop").step(*_batch(3))
    assert len(reward_server.requests[route]) == 1


def test_a_server_that_closes_the_connection_is_retried_then_named(hang_up_url):
    url, tcp = hang_up_url
    before = tcp.connections
    with pytest.raises(RewardServerError, match=rf"{url} failed 2 times .*no answer"):
        _env(url, max_attempts=2).step(*_batch(2))
    assert tcp.connections - before == 2


def test_a_column_that_is_not_json_is_named():
    logs, metadata = _batch(2)
    metadata[1]["when"] = object()
    with pytest.raises(ValueError, match=r"sample 1's column 'when' cannot be sent"):
        _env("http://127.0.0.1:9/score").step(logs, metadata)


def test_the_url_must_be_http():
    with pytest.raises(ValueError, match="no http:// or https:// URL"):
        HttpRewardEnvConfig(url="reward-host:8000")


GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guides" / "reward-servers.md"


def test_the_guides_recipe_validates_and_its_request_is_what_is_sent(reward_server):
    text = GUIDE.read_text()
    (recipe,) = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    request, answer = (json.loads(b) for b in re.findall(r"```json\n(.*?)```", text, flags=re.S))
    config = yaml.safe_load(recipe)["env"]["qa"]["config"]
    assert HttpRewardEnvConfig(**config).on_failure == "fail"
    (item,) = request["items"]
    log = [*item["prompt"], {"role": "assistant", "content": item["completion"]}]
    out = _env(f"{reward_server.url}/score").step([log], [item["columns"]])
    assert reward_server.requests["score"] == [request]
    assert out.rewards.tolist() == answer["scores"]


def test_an_answer_trickled_out_past_timeout_s_is_cut(reward_server):
    """Each byte comes well within httpx's per-read timeout, the whole answer does not: read
    to its end (2 s), it would score."""
    url = f"{reward_server.url}/trickle"
    env = _env(url, timeout_s=0.5, max_attempts=1)
    with pytest.raises(RewardServerError, match=rf"{url} failed 1 times .*timed out after 0.5s"):
        env.step(*_batch(2))


def test_a_score_too_large_for_a_float_names_its_item(reward_server):
    url = f"{reward_server.url}/huge-int"
    with pytest.raises(RewardServerError, match=r"item 2 of the batch; expected a finite number"):
        _env(url).step(*_batch(3))
