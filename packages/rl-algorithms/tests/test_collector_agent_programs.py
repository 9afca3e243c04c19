"""Async GRPO's trajectory collector with agent programs (``agent_program``) playing the
groups through its OpenAI-compatible endpoint: the versions their tokens carry, programs that
never ask, pauses, hung programs and cancelled groups. The engine and helpers are those of
test_collector_agent_loop.py."""

import json
import time
from collections import Counter
from pathlib import Path

from rl_algorithms.agent_programs.config import AgentProgramConfig

from .test_collector_agent_loop import (
    G,
    InProcessEngine,
    collector,
    train,
    validate_while_generating,
)

PROGRAMS = Path(__file__).with_name("agent_program_examples.py")


def program(name: str) -> AgentProgramConfig:
    return AgentProgramConfig(function=f"{PROGRAMS}:{name}", result_column="agent_result")


def test_agent_program_groups_are_collected_with_the_versions_of_their_tokens(tokenizer, template):
    engine = InProcessEngine(tokenizer)
    metas = [{"turns": 1, "constant": True} for _ in range(4)]
    client = collector(
        tokenizer, template, engine, metas, max_age_steps=0, agent_program=program("talk")
    )
    try:
        # Each step's groups are admitted once the step before them is trained on.
        steps, _, reply, _, _ = train(client, engine, n=2, steps=2, span=4)
    finally:
        client.stop()
    groups = [g for s in steps for g in s]
    assert Counter(int(g.prompt["idx"][0]) for g in groups) == Counter(range(4))
    assert reply.requeued_groups == reply.aborted_groups == reply.discarded_tokens == 0
    for g in groups:
        assert g.result.end_reasons == ["agent_returned"] * G
        assert g.result.sample_mask().tolist() == [1.0] * G
        episodes = zip(
            g.result.message_logs,
            g.result.env_metadata,
            g.version_min.tolist(),
            g.version_max.tolist(),
            strict=True,
        )
        for log, meta, vmin, vmax in episodes:
            turns = [(m, m["token_loss_mask"].bool()) for m in log if "token_loss_mask" in m]
            # The tokens trained on are those the endpoint returned to the program.
            seen = [s["token_ids"] for s in meta["agent_result"]["seen"]]
            assert [m["token_ids"][kept].tolist() for m, kept in turns] == seen
            # Each turn carries the version its stream started on; a later turn is no older.
            tags = [m["generation_versions"][kept] for m, kept in turns]
            assert all(len(set(t.tolist())) == 1 for t in tags)
            firsts = [int(t[0]) for t in tags]
            assert firsts == sorted(firsts) and vmin == firsts[0] and vmax >= firsts[-1]
    # The engine's weights moved on between steps: later groups were sampled by newer ones.
    assert len({int(g.version_min.min()) for g in groups}) > 1
    batch = groups[-1].result.training_batch(tokenizer.pad_token_id)
    assert bool((batch.extras["generation_versions"][batch.loss_mask > 0] >= 0).all())


def test_a_group_whose_programs_never_ask_is_collected_at_its_admission_version(
    tokenizer, template
):
    # No episode sampled a token, so none reports a weight version: the group takes the
    # engine's version at its admission, and the run goes on.
    engine = InProcessEngine(tokenizer)
    engine.version = 3
    metas = [{"turns": 1, "constant": True} for _ in range(2)]
    client = collector(tokenizer, template, engine, metas, agent_program=program("never_asks"))
    try:
        steps, _, reply, _, _ = train(client, engine, n=1, steps=2, span=4)
    finally:
        client.stop()
    assert reply.requeued_groups == 0
    for [group] in steps:
        assert group.result.end_reasons == ["agent_failed/no_requests"] * G
        assert group.result.sample_mask().tolist() == [0.0] * G
        # The engine's version when the group was admitted (3, or 4 after the first refit),
        # not a made-up 0 that would read as a group older than the run.
        [version] = set(group.version_min.tolist() + group.version_max.tolist())
        assert version in (3, 4)


def test_time_paused_for_validation_counts_against_no_programs_deadline(tokenizer, template):
    # Programs asking for their first reply when validation pauses the collector for longer
    # than their max_episode_seconds: after resume they are answered, and return.
    engine = InProcessEngine(tokenizer, seconds=0.05)
    talk = AgentProgramConfig(
        function=f"{PROGRAMS}:talk", result_column="agent_result", max_episode_seconds=2.0
    )
    client = collector(
        tokenizer, template, engine, [{"turns": 1, "constant": True}] * 2, agent_program=talk
    )
    try:
        validate_while_generating(client, seconds=2.5)
        groups, _, reply, _, _ = train(client, engine, n=1, steps=2, span=4)
    finally:
        client.stop()
    assert reply.requeued_groups == 0
    for [group] in groups:
        assert group.result.end_reasons == ["agent_returned"] * G


def reported(report: Path, lines: int) -> list[dict]:
    """The errors the programs wrote to ``report``, once there are ``lines`` (10 s at most)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if report.exists() and len(report.read_text().splitlines()) >= lines:
            break
        time.sleep(0.02)
    return [json.loads(line) for line in report.read_text().splitlines()]


def test_a_hung_agent_program_is_cut_and_its_prompt_generated_again(tokenizer, template, tmp_path):
    # The first attempt's programs ask once, then hang in their own code (their deadline,
    # max_episode_seconds, is 300 s away): the group is cut at max_group_seconds.
    report = tmp_path / "report.jsonl"
    metas = [{"turns": 1, "constant": True, "report": str(report), "hangs": G}]
    engine = InProcessEngine(tokenizer)
    client = collector(
        tokenizer,
        template,
        engine,
        metas,
        max_group_seconds=3.0,  # (a busy machine's slowest good attempt stays within it)
        agent_program=program("hangs_the_first_time"),
    )
    try:
        [[group]], _, reply, _, _ = train(client, engine, n=1, steps=1, span=4)
        assert reply.requeued_groups == 1 and group.requeues == 1
        assert group.result.end_reasons == ["agent_returned"] * G
        assert reply.discarded_tokens > 0  # the cut attempt's first replies
        # Its rollout ended though its programs still hang: no thread waits for them.
        assert reply.stuck_groups == 0
        Path(f"{report}.release").touch()  # the hung programs ask again: refused
        errors = reported(report, G)
    finally:
        client.stop()
    assert len(errors) == G
    assert all(e["status"] == 400 and "has ended" in e["message"] for e in errors), errors


def test_a_cancelled_groups_request_in_flight_gets_an_error_its_program_sees(
    tokenizer, template, tmp_path
):
    report = tmp_path / "report.jsonl"
    engine = InProcessEngine(tokenizer, hang=True)  # no request is ever answered
    client = collector(
        tokenizer,
        template,
        engine,
        [{"turns": 1, "report": str(report)}],
        max_group_seconds=2.0,  # (long enough for the programs to have asked by then)
        max_groups_ahead=1,
        agent_program=program("talks_and_reports_errors"),
    )
    try:
        errors = reported(report, G)
        assert client.requeued >= 1
    finally:
        client.stop()
    assert all(e["status"] == 400 for e in errors)
    assert any("ran past max_group_seconds=2" in e["message"] for e in errors), errors
    assert engine.streams == {}  # nothing left running on the engine
    assert client.requests_in_flight() == {"waiting": 0, "running": 0}
