"""Agent programs through the OpenAI-compatible endpoint: the real server (uvicorn on a free
port), real ``openai`` clients, a real tokenizer and chat template; the generator is a test
double whose sampled ids do not survive a decode / encode round trip, so any re-tokenisation
of what was sampled would show. The programs are in agent_program_examples.py."""

import itertools
import json
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from rl_algorithms.agent_programs.config import AgentProgramConfig
from rl_algorithms.agent_programs.programs import run_program_rollouts
from rl_algorithms.agent_programs.server import EndpointServer, Episode, GenerationBatcher
from rl_algorithms.agent_programs.trajectories import Sample, Trajectory
from rl_data.messages import tokenize_message_logs
from rl_data.templates import ChatTemplate, ChatTemplateConfig
from rl_data.tokenizers import build_tokenizer
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn
from rl_envs.tools.registry import ToolSpec, tool_schema

from .test_agent_loop import RandomTokenGeneration
from .test_tool_rollout import CALL, ScriptedGeneration

PROGRAMS = Path(__file__).with_name("agent_program_examples.py")


class FinalAnswerEnv(EnvironmentInterface):
    """Scores a final conversation: 1 when its last assistant turn says the row's ``answer``
    (the turn's text, or its token ids when the row gives ``answer_ids``). Keeps the logs."""

    def __init__(self):
        self.logs = []

    def step(self, message_log_batch, metadata):
        self.logs += message_log_batch
        rewards = []
        for log, meta in zip(message_log_batch, metadata, strict=True):
            last = [m for m in log if m["role"] == "assistant"][-1]
            rewards.append(float(last["content"].strip() == meta.get("answer")))
        n = len(rewards)
        return EnvironmentReturn(
            observations=[[] for _ in range(n)],
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=[None] * n,
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


@pytest.fixture(scope="module")
def server():
    endpoint = EndpointServer()
    yield endpoint
    endpoint.close()


def prompts(tokenizer, template, rows, tools=None):
    logs = [[{"role": "user", "content": f"[sample {k}] Solve this"}] for k in range(len(rows))]
    tokenize_message_logs(
        logs, tokenizer, template, add_generation_prompt=True, tools=[tools] * len(rows)
    )
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[{**row, **({"tools": tools} if tools else {})} for row in rows],
        task_name=["task"] * len(rows),
        idx=torch.arange(len(rows)),
    )


def roll(server, gen, batch, tokenizer, template, env=None, max_seq_len=256, **config):
    config = AgentProgramConfig(**{"result_column": "agent_result", **config})
    return run_program_rollouts(
        server,
        config,
        gen,
        batch,
        tokenizer,
        template,
        {"task": env or FinalAnswerEnv()},
        max_seq_len=max_seq_len,
        temperature=1.0,
        top_p=1.0,
    )


def sampled(log):
    """Each assistant turn's sampled ids (those in the loss)."""
    return [
        m["token_ids"][m["token_loss_mask"].bool()].tolist() for m in log if "token_loss_mask" in m
    ]


def test_an_episode_is_one_trajectory_of_exactly_the_sampled_tokens(server, tokenizer, template):
    gen = RandomTokenGeneration(tokenizer)
    batch = prompts(tokenizer, template, [{}, {}])
    result = roll(server, gen, batch, tokenizer, template, function=f"{PROGRAMS}:talk")

    assert result.end_reasons == ["agent_returned"] * 2
    assert result.sample_mask().tolist() == [1.0, 1.0]
    assert result.turns.tolist() == [2, 2]
    for i, log in enumerate(result.message_logs):
        seen = result.env_metadata[i]["agent_result"]["seen"]
        # What the endpoint returned is, byte for byte, what the trajectory trains on...
        assert sampled(log) == [s["token_ids"] for s in seen]
        assert [s["content"] for s in seen] == [
            tokenizer.decode(s["token_ids"], skip_special_tokens=True) for s in seen
        ]
        # ...and the second request was generated from the trajectory's own ids: the first
        # prompt, the first sample as it was (never its text re-tokenised), then the new turn.
        prompts_of = {tuple(s.tolist()): p.tolist() for p, s, _ in gen.rows}
        second_prompt = prompts_of[tuple(seen[1]["token_ids"])]
        first_prompt = batch["message_log"][i][0]["token_ids"].tolist()
        assert second_prompt == torch.cat([m["token_ids"] for m in log[:-1]]).tolist()
        after = second_prompt[len(first_prompt) :]
        assert second_prompt[: len(first_prompt)] == first_prompt
        assert after[: len(seen[0]["token_ids"])] == seen[0]["token_ids"]
        # Each turn's log-probs are the ones it was sampled with.
        logprobs_of = {tuple(s.tolist()): lp for _, s, lp in gen.rows}
        for message, s in zip([m for m in log if "token_loss_mask" in m], seen, strict=True):
            kept = message["token_loss_mask"].bool()
            torch.testing.assert_close(
                message["generation_logprobs"][kept], logprobs_of[tuple(s["token_ids"])]
            )
    # Only sampled tokens are in the loss; their log-probs are the generator's.
    train = result.training_batch(tokenizer.pad_token_id)
    assert int(train.loss_mask.sum()) == sum(
        len(t) for log in result.message_logs for t in sampled(log)
    )
    assert result.metrics["agent_program/failed_episodes"] == 0


def test_concurrent_requests_of_many_episodes_share_generate_calls(
    server, tokenizer, template, monkeypatch
):
    # Every episode's request is counted as it queues, so that the first call can wait for
    # them all (a sleep could end before a slow episode's request arrived).
    submitted, all_submitted = itertools.count(1), threading.Event()
    submit = GenerationBatcher.submit

    def counted_submit(self, prompt, stops):
        future = submit(self, prompt, stops)
        if next(submitted) == 8:
            all_submitted.set()
        return future

    monkeypatch.setattr(GenerationBatcher, "submit", counted_submit)

    class SlowFirstCall(RandomTokenGeneration):
        """The first call lasts until the other episodes' requests have queued behind it."""

        def generate(self, data, greedy=False, *, expected_weight_version=None):
            if not self.rows:
                assert all_submitted.wait(60), "not every episode's request arrived"
            self.sizes = [*getattr(self, "sizes", []), data.size]
            return super().generate(data, greedy, expected_weight_version=expected_weight_version)

    gen = SlowFirstCall(tokenizer)
    batch = prompts(tokenizer, template, [{}] * 8)
    result = roll(server, gen, batch, tokenizer, template, function=f"{PROGRAMS}:talk_async")
    assert result.end_reasons == ["agent_returned"] * 8
    assert sum(gen.sizes) == 8 and len(gen.sizes) <= 2, gen.sizes
    assert [r["agent_result"] for r in result.env_metadata] == [
        s for log in result.message_logs for s in sampled(log)
    ]


def test_tool_calls_come_back_parsed_and_the_tool_reply_is_read_not_trained(server):
    tools = [tool_schema(ToolSpec(function="calculator"))]
    texts = [CALL, "56088 123*456 What is calculator expression", json.dumps(tools)] * 20
    tokenizer = build_tokenizer(texts, vocab_size=600)
    template = ChatTemplate.from_config(ChatTemplateConfig(kind="chatml_tools"), tokenizer)
    batch = prompts(tokenizer, template, [{"answer": "56088"}], tools=tools)
    env = FinalAnswerEnv()
    result = roll(
        server,
        ScriptedGeneration(tokenizer),
        batch,
        tokenizer,
        template,
        env,
        function=f"{PROGRAMS}:uses_a_tool",
        max_seq_len=1024,
    )
    got = result.env_metadata[0]["agent_result"]
    assert got["call"] == ["calculator", {"expression": "123*456"}, "tool_calls"]
    assert got["answer"] == "56088"
    assert result.rewards.tolist() == [1.0]
    log = result.message_logs[0]
    assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
    assert "token_loss_mask" not in log[2] and log[2]["content"] == "56088"
    # The trajectory is what the template renders for the conversation, token for token.
    text = tokenizer.decode(torch.cat([m["token_ids"] for m in log]).tolist())
    plain = [{k: v for k, v in m.items() if k in ("role", "content", "tool_call_id")} for m in log]
    assert text == template.render(plain, tools=tools)


def test_bad_agents_are_cut_counted_and_kept_out_of_the_loss(server, tokenizer, template, tmp_path):
    behaviours = ["good", "never_calls", "raises", "hangs", "diverges"]
    report = tmp_path / "late.txt"
    rows = [{"behaviour": b, "report": str(report)} for b in behaviours]
    batch = prompts(tokenizer, template, rows)
    result = roll(
        server,
        RandomTokenGeneration(tokenizer),
        batch,
        tokenizer,
        template,
        function=f"{PROGRAMS}:misbehave",
        # Long enough for the good program's two requests on a busy machine: the hung one
        # is held past it whatever it is, so it costs this test its length once.
        max_episode_seconds=5.0,
    )
    # The hung program was not waited for: it is held until now (see ``misbehave``). Its
    # late call is counted from here, so the count is read before it is released.
    late_before = server.late_requests
    report.with_suffix(".release").touch()
    assert result.end_reasons == [
        "agent_returned",
        "agent_failed/no_requests",
        "agent_failed/error",
        "agent_failed/timeout",
        "agent_failed/diverged",
    ]
    assert result.sample_mask().tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.rewards[1:].tolist() == [0.0] * 4  # never scored
    m = result.metrics
    assert m["agent_program/failed_episodes"] == 4
    for reason in ("no_requests", "error", "timeout", "diverged"):
        assert m[f"agent_program/failed/{reason}"] == 1
    assert "does not extend" in result.env_metadata[4]["agent_result"]["refusal"]
    # Never a corrupt trajectory: each failed one holds what it recorded (one request) or
    # its prompt, and trains on nothing.
    assert result.turns.tolist() == [2, 0, 1, 1, 1]
    assert result.message_logs[1] == batch["message_log"][1]
    train = result.training_batch(tokenizer.pad_token_id)
    assert (train.loss_mask.sum(1) > 0).tolist() == [True, False, True, True, True]
    # The hung program's call after its deadline is refused and counted.
    deadline = time.monotonic() + 10
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "has ended" in report.read_text()
    assert server.late_requests == late_before + 1
    # So is any call on an episode of a rollout that is over.
    url = result.env_metadata[0]["agent_result"]["base_url"]
    response = httpx.post(
        f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 400 and "has ended" in response.json()["error"]["message"]
    assert server.late_requests == late_before + 2


def test_requests_for_sampling_the_run_does_not_do_are_refused_plainly(server, tokenizer, template):
    batch = prompts(tokenizer, template, [{}])
    result = roll(
        server,
        RandomTokenGeneration(tokenizer),
        batch,
        tokenizer,
        template,
        function=f"{PROGRAMS}:asks_for_what_the_run_does_not_do",
    )
    got = result.env_metadata[0]["agent_result"]
    assert "stream" in got["refusals"]["stream"]
    assert "temperature 0.3 differs from the run's (1.0" in got["refusals"]["temperature"]
    assert "n must be 1" in got["refusals"]["n"]
    # An explicit 0 is refused, not read as "not given" (and max_tokens used instead).
    assert (
        "max_completion_tokens must be at least 1, got 0"
        in (got["refusals"]["max_completion_tokens"])
    )
    # max_tokens cuts the sample; what was cut off is not trained on.
    assert got["finish"] == "length" and len(got["ids"]) == 2
    assert sampled(result.message_logs[0]) == [got["ids"]]
    assert result.end_reasons == ["agent_returned"] and bool(result.truncated[0])


def test_completions_and_plain_http_and_a_command_are_recorded_the_same(
    server, tokenizer, template, tmp_path
):
    gen = RandomTokenGeneration(tokenizer)
    batch = prompts(tokenizer, template, [{}])
    result = roll(server, gen, batch, tokenizer, template, function=f"{PROGRAMS}:completes_text")
    assert sampled(result.message_logs[0]) == result.env_metadata[0]["agent_result"]
    assert result.end_reasons == ["agent_returned"]

    result = roll(server, gen, batch, tokenizer, template, function=f"{PROGRAMS}:over_http")
    assert sampled(result.message_logs[0]) == [result.env_metadata[0]["agent_result"]]

    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys, httpx\n"
        "row = json.load(sys.stdin)\n"
        "r = httpx.post(os.environ['OPENAI_BASE_URL'] + '/chat/completions',"
        " json={'messages': row['messages']})\n"
        "print(json.dumps(r.json()['choices'][0]['token_ids']))\n"
    )
    import sys

    result = roll(server, gen, batch, tokenizer, template, command=f"{sys.executable} {script}")
    assert result.end_reasons == ["agent_returned"]
    assert sampled(result.message_logs[0]) == [result.env_metadata[0]["agent_result"]]


def test_the_config_names_the_program_exactly_once():
    with pytest.raises(ValueError, match="exactly one of them"):
        AgentProgramConfig()
    with pytest.raises(ValueError, match="exactly one of them"):
        AgentProgramConfig(function="a:b", command="x")
    with pytest.raises(ValueError, match=r"agent_program\.function 'nocolon'"):
        AgentProgramConfig(function="nocolon")
    with pytest.raises(ValueError, match="max_episode_seconds"):
        AgentProgramConfig(function="a:b", max_episode_seconds=0)


def test_a_generator_failure_is_the_runs_not_the_agents(server, tokenizer, template):
    class Broken(RandomTokenGeneration):
        def generate(self, data, greedy=False, *, expected_weight_version=None):
            raise RuntimeError("the generator broke")

    batch = prompts(tokenizer, template, [{}])
    with pytest.raises(RuntimeError, match="the generator broke"):
        roll(server, Broken(tokenizer), batch, tokenizer, template, function=f"{PROGRAMS}:talk")
    assert threading.active_count() < 50


def test_a_request_the_template_refuses_changes_nothing_and_can_be_retried(server, tokenizer):
    # The test tokenizer's own template, with the check many real ones make (Gemma's, Llama 2's).
    source = (
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('a system message must come first') }}{% endif %}{% endfor %}"
        + tokenizer.chat_template
    )
    template = ChatTemplate.from_config(
        ChatTemplateConfig(kind="jinja", template=source), tokenizer
    )
    batch = prompts(tokenizer, template, [{}])
    result = roll(
        server,
        RandomTokenGeneration(tokenizer),
        batch,
        tokenizer,
        template,
        function=f"{PROGRAMS}:retries_what_the_template_refuses",
    )
    got = result.env_metadata[0]["agent_result"]
    assert "chat template cannot render" in got["refusal"]
    assert "a system message must come first" in got["refusal"]
    # The refused request left no trace: the trajectory is the retried conversation, whole.
    assert result.end_reasons == ["agent_returned"] and result.sample_mask().tolist() == [1.0]
    log = result.message_logs[0]
    assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant"]
    assert sampled(log) == got["seen"]
    text = tokenizer.decode(torch.cat([m["token_ids"] for m in log]).tolist())
    assert text == template.render([{"role": m["role"], "content": m["content"]} for m in log])


def test_no_room_left_refuses_the_request_and_keeps_the_last_answer_last(
    server, tokenizer, template
):
    batch = prompts(tokenizer, template, [{}])
    result = roll(
        server,
        RandomTokenGeneration(tokenizer),
        batch,
        tokenizer,
        template,
        function=f"{PROGRAMS}:outgrows_the_context",
    )
    got = result.env_metadata[0]["agent_result"]
    assert "no room left to generate" in got["refusal"]
    # Trained and scored on what the model answered, not on a question left unanswered.
    assert result.end_reasons == ["token_limit"] and result.sample_mask().tolist() == [1.0]
    assert bool(result.truncated[0]) and result.turns.tolist() == [1]
    log = result.message_logs[0]
    assert [m["role"] for m in log] == ["user", "assistant"]
    assert sampled(log) == got["seen"]


class HeldTemplate:
    """A chat template that, for a conversation saying "hold", waits until ``release`` is set
    (a template or tokenizer slow on a very long conversation)."""

    def __init__(self, template):
        self.template, self.holding, self.release = template, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.template, name)

    def message_texts(self, log, *args, **kwargs):
        if any(m.get("content") == "hold" for m in log):
            self.holding.set()
            self.release.wait(10)
        return self.template.message_texts(log, *args, **kwargs)


@contextmanager
def episodes_of(server, tokenizer, templates, max_request_bytes=2**20):
    """One registered episode per template, sharing one generator queue."""
    batcher = GenerationBatcher(
        RandomTokenGeneration(tokenizer), tokenizer.pad_token_id, False, None
    )
    trajectories = [Trajectory(server.new_episode_id(), tokenizer, t, 256, 4) for t in templates]
    for t in trajectories:
        server.register(Episode(t, batcher, 1.0, 1.0, "hermes", max_request_bytes))
    try:
        yield [f"{server.base_url(t.episode_id)}/chat/completions" for t in trajectories]
    finally:
        batcher.close()
        server.unregister([t.episode_id for t in trajectories])


def test_a_slow_template_holds_up_only_its_own_episode(server, tokenizer, template):
    held = HeldTemplate(template)
    with episodes_of(server, tokenizer, [held, template]) as (slow, quick):
        try:
            with ThreadPoolExecutor(1) as pool:
                hold = {"messages": [{"role": "user", "content": "hold"}]}
                slow_reply = pool.submit(httpx.post, slow, json=hold, timeout=10)
                assert held.holding.wait(5)
                # Served while the other episode's template is still at work.
                go = {"messages": [{"role": "user", "content": "go"}]}
                assert httpx.post(quick, json=go, timeout=2).status_code == 200
                held.release.set()
                assert slow_reply.result().status_code == 200
        finally:
            held.release.set()


def test_a_body_over_the_size_limit_is_refused_with_413(server, tokenizer, template):
    # (a long field the endpoint does not read: the limit is on bytes, whatever they hold)
    request = {"messages": [{"role": "user", "content": "Solve this"}], "user": "x" * 3000}
    body = json.dumps(request).encode()
    with episodes_of(server, tokenizer, [template], max_request_bytes=len(body) - 1) as [url]:
        sized = httpx.post(url, content=body, headers={"content-type": "application/json"})
        # Sent in chunks without a Content-Length: cut as it arrives.
        chunked = httpx.post(url, content=iter([body[:1000], body[1000:]]))
        for response in (sized, chunked):
            assert response.status_code == 413
            assert "agent_program.max_request_bytes" in response.json()["error"]["message"]
    with episodes_of(server, tokenizer, [template], max_request_bytes=len(body)) as [url]:
        assert httpx.post(url, content=body).status_code == 200


def test_a_result_that_cannot_be_sent_on_fails_its_episode_not_the_run(
    server, tokenizer, template, tmp_path
):
    behaviours = ("good", "unpicklable", "local_class")
    rows = [{"behaviour": b, "report": str(tmp_path / "r")} for b in behaviours]
    result = roll(
        server,
        RandomTokenGeneration(tokenizer),
        prompts(tokenizer, template, rows),
        tokenizer,
        template,
        function=f"{PROGRAMS}:misbehave",
    )
    # A class defined in the program: Ray could send it, async GRPO's checkpoints could not.
    assert result.end_reasons == ["agent_returned", "agent_failed/error", "agent_failed/error"]
    assert result.sample_mask().tolist() == [1.0, 0.0, 0.0]
    assert result.env_metadata[1]["agent_result"] is None
    pickle.dumps(result.env_metadata)  # what goes on to the trainer and checkpoints now can


def test_malformed_tool_calls_get_a_400_naming_the_message(server, tokenizer, template):
    user = {"role": "user", "content": "Solve this"}
    cases = [
        (5, "messages[1].tool_calls must be a list, got int"),
        ({"function": {"name": "f"}}, "messages[1].tool_calls must be a list, got dict"),
        ([{"function": {}}], "messages[1].tool_calls[0]: a tool call needs function.name"),
    ]
    with episodes_of(server, tokenizer, [template]) as [url]:
        for calls, message in cases:
            sent = [user, {"role": "assistant", "content": "", "tool_calls": calls}, user]
            response = httpx.post(url, json={"messages": sent})
            assert response.status_code == 400, response.text
            assert message in response.json()["error"]["message"]
        # The episode is untouched: a well-formed first request is still answered.
        assert httpx.post(url, json={"messages": [user]}).status_code == 200


class EveryAnswerRight(FinalAnswerEnv):
    """Scores every final conversation 1 (a failed episode is scored 0 before it gets here)."""

    def step(self, message_log_batch, metadata):
        returned = super().step(message_log_batch, metadata)
        return returned._replace(rewards=torch.ones(len(message_log_batch)))


def test_rl_eval_plays_its_samples_through_the_agent_program(server, tokenizer, template, tmp_path):
    from rl_algorithms.eval import MasterConfig, evaluate
    from rl_algorithms.run import Run
    from rl_algorithms.utils.logger import Logger, LoggerConfig

    samples = tmp_path / "samples.jsonl"
    config = MasterConfig.model_validate(
        {
            "model": {"path": "unused: the generator is a test double"},
            "tokenizer": {"path": "unused"},
            "env": {"task": {"kind": "math"}},
            "data": {"dataset": {"source": "arithmetic"}},
            "eval": {
                "num_tests_per_prompt": 2,
                "output_file": str(samples),
                "agent_program": {"function": f"{PROGRAMS}:misbehave"},
            },
        }
    )
    rows = [{"behaviour": "good"}, {"behaviour": "never_calls"}]
    run = Run(
        name="eval",
        config=config,
        tokenizer=tokenizer,
        template=template,
        train_loader=[prompts(tokenizer, template, rows)],  # type: ignore[arg-type]
        val_loader=None,
        logger=Logger(LoggerConfig(log_dir=str(tmp_path / "logs"), progress_bar=False)),
        checkpointer=None,
        clusters=[],
        total_steps=0,
        generation=RandomTokenGeneration(tokenizer),
        envs={"task": EveryAnswerRight()},
        agent_endpoint=server,
    )
    metrics = evaluate(run)
    # The good program's two samples are right; the one that never calls the model fails.
    assert metrics["pass@1"] == 0.5 and metrics["num_samples"] == 4
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    good = [r for r in records if r["prompt_idx"] == 0]
    assert [r["correct"] for r in good] == [True, True]
    # Its response is the program's conversation: its second request's own user turn in it.
    assert all("Once more." in r["response"] for r in good)
    assert [r["correct"] for r in records if r["prompt_idx"] == 1] == [False, False]
    # The report says why: two failed episodes (no request made), two requests each for the
    # others, so that a broken program does not read as a weak model.
    assert metrics["agent_program/failed_episodes"] == 2
    assert metrics["agent_program/failed/no_requests"] == 2
    assert metrics["agent_program/failed/error"] == 0
    assert metrics["agent_program/requests_mean"] == 1.0


def test_a_reply_cut_at_a_limit_keeps_the_versions_of_the_tokens_it_keeps():
    # A refit landed after the second token: the cut reply took no part in versions 5.
    sample = Sample(
        ids=torch.tensor([7, 8, 9, 10]),
        logprobs=torch.tensor([-0.1, -0.2, -0.3, -0.4]),
        truncated=False,
        weight_version=0,
        versions=torch.tensor([0, 1, 5, 5]),
        version_max=5,
    )
    cut = sample.cut(2)
    assert cut.ids.tolist() == [7, 8] and cut.logprobs.tolist() == pytest.approx([-0.1, -0.2])
    assert cut.versions.tolist() == [0, 1] and cut.truncated
    assert (cut.weight_version, cut.version_max) == (0, 1)
    assert sample.cut(4) is sample and sample.cut(0).versions.tolist() == []
