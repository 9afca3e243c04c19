"""The replay buffer of asynchronous GRPO: ages in trainer steps, stale groups dropped and
counted, oldest groups first, and a checkpoint round trip across a resumed policy's fresh
weight-version numbering."""

import pickle
from types import SimpleNamespace

import pytest
import torch

from rl_algorithms.grpo.async_loop import Trajectories, discarded_token_fraction
from rl_algorithms.grpo.collector_client import CollectorError, check_reply
from rl_algorithms.grpo.collector_reply import CollectorReply
from rl_algorithms.grpo.replay_buffer import ReplayBuffer, TrajectoryGroup
from rl_algorithms.rollouts import RolloutResult
from rl_distributed.batched_data_dict import BatchedDataDict

G = 2


def group(
    version_min: list[int], version_max: list[int] | None = None, tag: str = ""
) -> TrajectoryGroup:
    result = RolloutResult(
        message_logs=[[{"role": "assistant", "content": tag}] for _ in version_min],
        rewards=torch.zeros(len(version_min)),
        truncated=torch.zeros(len(version_min), dtype=torch.bool),
        terminated=torch.ones(len(version_min), dtype=torch.bool),
        turns=torch.ones(len(version_min), dtype=torch.long),
        env_metadata=[None] * len(version_min),
        answers=[None] * len(version_min),
    )
    return TrajectoryGroup(
        prompt=BatchedDataDict(tag=[tag]),
        result=result,
        version_min=torch.tensor(version_min),
        version_max=torch.tensor(version_max or version_min),
    )


def tags(groups):
    return [g.prompt["tag"][0] for g in groups]


def reply(groups=(), running=(), exhausted=False) -> CollectorReply:
    counts = dict.fromkeys(
        ["requeued_groups", "aborted_groups", "stale_requeued_groups", "filtered_groups"], 0
    )
    return CollectorReply(
        groups=list(groups),
        error=None,
        exhausted=exhausted,
        generated_tokens=0,
        discarded_tokens=0,
        generator_idle_seconds=0.0,
        groups_running=len(running),
        running_versions=tuple(running),
        stuck_groups=0,
        heartbeat_age_seconds=0.0,
        doing="",
        **counts,
    )


class ScriptedCollector:
    """A collector client answering each ``take`` with the next scripted reply (the last one
    again when they run out), checked as the real client checks them."""

    def __init__(self, replies: list[CollectorReply]) -> None:
        self.replies, self.lags = list(replies), []

    def take(self, consumed, timeout, stale=None, lag=0):
        self.lags.append(lag)
        answer = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        return check_reply(answer, self.describe(), 60.0, lag)

    def describe(self):
        return "scripted collector"


def test_a_step_waits_for_a_running_group_at_its_last_step_only():
    buffer = ReplayBuffer(max_age_steps=2)
    for step in range(4):
        buffer.record_step(step, step)  # version v at step v
    buffer.add([group([3, 3], tag="a"), group([3, 3], tag="b")])
    # Step 3: a group admitted under version 1 is at its span (3 - 1 = 2): the step waits
    # for it, and trains on it with one of the younger two waiting there.
    late = group([1, 1], tag="late")
    script = [reply(running=[1, 3]), reply(running=[1, 3]), reply([late]), reply()]
    collector = ScriptedCollector(script)
    trajectories = Trajectories(buffer, collector, max_wait=10)
    trajectories.last_reply = reply(running=[1, 3])
    taken, _ = trajectories.take(2, step=3)
    assert sorted(tags(taken)) == ["a", "late"] and trajectories.straggler_waits == 1
    assert buffer.dropped_groups == 0

    # A group past its span (admitted under version 0: 3 - 0 > 2) is not waited for: it would
    # be too old whenever it came.
    collector.replies = [reply(running=[0])]
    trajectories.last_reply = reply(running=[0])
    buffer.add([group([3, 3], tag="c")])
    taken, _ = trajectories.take(2, step=3)
    assert sorted(tags(taken)) == ["b", "c"] and trajectories.straggler_waits == 1


def test_a_step_short_of_groups_anyway_is_no_straggler_wait():
    buffer = ReplayBuffer(max_age_steps=2)
    for step in range(4):
        buffer.record_step(step, step)
    buffer.add([group([3, 3], tag="a")])
    # Step 3 needs two groups and holds one: it waits while the group at its span runs, but
    # would have waited without it too. The straggler is the group that completes the step.
    late = group([1, 1], tag="late")
    collector = ScriptedCollector([reply(running=[1]), reply([late]), reply()])
    trajectories = Trajectories(buffer, collector, max_wait=10)
    trajectories.last_reply = reply(running=[1])
    taken, _ = trajectories.take(2, step=3)
    assert sorted(tags(taken)) == ["a", "late"] and trajectories.straggler_waits == 0
    assert len(buffer) == 0 and buffer.dropped_groups == 0

    # Short at first, then a young group arrives while the straggler still runs: from then on
    # the straggler alone holds the step up, and it counts.
    buffer.add([group([3, 3], tag="b")])
    late = group([1, 1], tag="late2")
    script = [reply([group([3, 3], tag="c")], running=[1]), reply(running=[1]), reply([late])]
    collector.replies = [*script, reply()]
    trajectories.last_reply = reply(running=[1])
    taken, _ = trajectories.take(2, step=3)
    assert sorted(tags(taken)) == ["b", "late2"] and trajectories.straggler_waits == 1


def test_a_collector_out_of_prompts_is_no_error_while_the_buffer_holds_the_step():
    buffer = ReplayBuffer(max_age_steps=2)
    buffer.record_step(0, 0)
    buffer.add([group([0, 0], tag="a"), group([0, 0], tag="b")])
    collector = ScriptedCollector([reply(exhausted=True)])
    trajectories = Trajectories(buffer, collector, max_wait=10)
    trajectories.last_reply, trajectories.lag = reply(), 1  # after the last step's take
    taken, _ = trajectories.take(2, step=0)
    assert tags(taken) == ["a", "b"]
    with pytest.raises(CollectorError, match="ran out of prompts"):  # and none left now
        trajectories.take(2, step=1)


def test_ages_count_trainer_steps_not_optimiser_steps():
    buffer = ReplayBuffer(max_age_steps=1)
    # Two optimiser steps per GRPO step: versions 0, 2, 4 at steps 0, 1, 2.
    for step, version in [(0, 0), (1, 2), (2, 4)]:
        buffer.record_step(step, version)
    # A sample started on version 2 and finished on 4 (an in-flight update): its age counts
    # from its oldest tokens.
    g = group([2, 4], [4, 4])
    buffer.add([g])
    assert buffer.ages(g, 2).tolist() == [1, 0]
    assert buffer.ages(g, 3).tolist() == [2, 1]


def test_take_gives_the_oldest_fresh_groups_and_drops_stale_ones():
    buffer = ReplayBuffer(max_age_steps=1)
    buffer.record_step(0, 0)
    buffer.add([group([0, 0], tag="a"), group([0, 0], tag="b")])
    buffer.record_step(1, 1)
    buffer.add([group([1, 1], tag="c")])
    assert tags(buffer.take(1, step=1)) == ["a"]  # age 1 still allowed
    buffer.record_step(2, 2)
    buffer.add([group([1, 2], [2, 2], tag="d"), group([2, 2], tag="e")])
    # At step 2, "b" (version 0) is two steps old: dropped and counted, never handed out.
    assert tags(buffer.take(2, step=2)) == ["c", "d"]
    # The dropped groups wait to be handed back (their prompts are generated again), once.
    assert tags(buffer.pop_stale()) == ["b"] and buffer.pop_stale() == []
    assert (buffer.dropped_groups, buffer.dropped_samples) == (1, G)
    assert buffer.take(2, step=2) is None  # only "e" is left: not enough
    assert len(buffer) == 1


def test_an_older_group_that_arrived_later_goes_first_and_dropped_tokens_are_counted():
    # A long episode started at step 0 finishes after a short one started at step 1: it is
    # trained on first (it is the one closest to the age cap).
    buffer = ReplayBuffer(max_age_steps=2)
    for step in range(2):
        buffer.record_step(step, step)
    buffer.add([group([1, 1], tag="short"), group([0, 1], [1, 1], tag="long")])
    assert tags(buffer.take(1, step=1)) == ["long"]
    late = group([0, 0], tag="late")
    late.result.metrics["completion_tokens"] = 7.0
    buffer.add([late])
    buffer.record_step(3, 3)
    assert tags(buffer.take(1, step=3)) == ["short"]  # "late" is 3 steps old: past the cap
    assert buffer.dropped_tokens == 7


def test_the_discarded_fraction_after_a_resume_counts_this_process_only():
    # The resumed buffer carries 1000 dropped tokens from before; the new collector has
    # generated 100 and discarded 10 since, and the buffer dropped 7 more: 17 / 100.
    state = ReplayBuffer(max_age_steps=2).state_dict() | {"dropped_tokens": 1000}
    buffer = ReplayBuffer(max_age_steps=2)
    buffer.load_state_dict(state)
    at_start = buffer.dropped_tokens
    buffer.dropped_tokens += 7
    reply = SimpleNamespace(generated_tokens=100, discarded_tokens=10)
    assert discarded_token_fraction(buffer, at_start, reply) == pytest.approx(0.17)


def test_zero_age_bound_keeps_only_current_weights():
    buffer = ReplayBuffer(max_age_steps=0)
    buffer.record_step(0, 0)
    buffer.add([group([0, 0], tag="old")])
    buffer.record_step(1, 1)
    buffer.add([group([0, 1], [1, 1], tag="mixed"), group([1, 1], tag="new")])
    assert tags(buffer.take(1, step=1)) == ["new"]
    assert buffer.dropped_groups == 2


def test_histogram_of_sample_ages():
    buffer = ReplayBuffer(max_age_steps=2)
    for step in range(3):
        buffer.record_step(step, step)
    groups = [group([0, 1]), group([2, 2])]
    buffer.add(groups)
    assert buffer.age_histogram(groups, step=2) == {0: 2, 1: 1, 2: 1}


def test_state_round_trip_survives_a_resumed_policy_numbering_versions_again():
    buffer = ReplayBuffer(max_age_steps=1)
    for step in range(4):
        buffer.record_step(step, 10 + step)
    buffer.add([group([12, 13], tag="x"), group([13, 13], tag="y")])
    state = pickle.loads(pickle.dumps(buffer.state_dict()))  # it goes through torch.save

    resumed = ReplayBuffer(max_age_steps=1)
    resumed.load_state_dict(state)
    # The resumed policy starts again at version 1 (loaded weights), at step 4.
    resumed.record_step(4, 1)
    assert tags(resumed.take(1, step=4)) == ["y"]  # "x" (oldest tokens: step 2) is too old
    assert (resumed.dropped_groups, resumed.dropped_samples) == (1, G)


def test_record_step_refuses_versions_going_back():
    buffer = ReplayBuffer(max_age_steps=1)
    buffer.record_step(0, 3)
    with pytest.raises(ValueError, match="went back from 3 to 1"):
        buffer.record_step(1, 1)


def async_grpo_args(*overrides: str) -> list[str]:
    """``rl grpo`` arguments for an async run on a separate vLLM engine (rejected before any
    file is read), plus ``overrides``."""
    return [
        "grpo",
        "policy.model.path=/nonexistent",
        "tokenizer.path=/nonexistent",
        "data.train={source: arithmetic, size: 8}",
        "env={arithmetic: {kind: math}}",
        "generation.backend=vllm",
        "generation.colocated=false",
        "generation.vllm.async_engine=true",
        *overrides,
    ]


def test_async_mode_without_importance_sampling_is_a_config_error_naming_the_key(capsys):
    from rl_algorithms import cli

    code = cli.main(async_grpo_args("grpo.async_grpo.enabled=true"))
    assert code == 2
    err = capsys.readouterr().err
    assert "loss_fn.use_importance_sampling_correction" in err
    assert "grpo.async_grpo.enabled" in err


def test_a_wait_limit_below_the_group_limit_is_a_config_error_naming_both_keys(capsys):
    from rl_algorithms import cli

    code = cli.main(
        async_grpo_args(
            "loss_fn.use_importance_sampling_correction=true",
            "grpo.async_grpo.enabled=true",
            "grpo.async_grpo.max_group_seconds=60",
            "grpo.async_grpo.max_wait_seconds=30",
        )
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "grpo.async_grpo.max_wait_seconds (30.0) must exceed" in err
    assert "grpo.async_grpo.max_group_seconds (60.0)" in err


def test_a_program_deadline_not_below_the_group_limit_is_a_config_error(capsys):
    from rl_algorithms import cli

    program = [
        "loss_fn.use_importance_sampling_correction=true",
        "grpo.async_grpo.enabled=true",
        "+grpo.agent_program.function=my_agent:play",
        "--print-config",
    ]
    # The defaults fit (240 s an episode, 300 s a group): the config is valid, and only the
    # test's made-up model path is left to refuse.
    assert cli.main(async_grpo_args(*program)) == 2
    err = capsys.readouterr().err
    assert "the run's input has" in err and "max_episode_seconds" not in err
    late = "+grpo.agent_program.max_episode_seconds=300"
    assert cli.main(async_grpo_args(*program, late)) == 2
    err = capsys.readouterr().err
    assert "grpo.agent_program.max_episode_seconds (300) must be below" in err
    assert "grpo.async_grpo.max_group_seconds (300)" in err


def test_multi_turn_and_dynamic_sampling_are_allowed_and_a_span_below_the_age_is_an_error(capsys):
    from rl_algorithms import cli

    args = async_grpo_args(
        "loss_fn.use_importance_sampling_correction=true",
        "grpo.async_grpo.enabled=true",
        "grpo.max_rollout_turns=4",
        "grpo.use_dynamic_sampling=true",
        "grpo.async_grpo.max_trajectory_age_steps=2",
        "grpo.async_grpo.max_trajectory_span_steps=1",
    )
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "grpo.async_grpo.max_trajectory_span_steps (1) must be >=" in err
    assert "max_rollout_turns" not in err and "use_dynamic_sampling" not in err


def test_a_judge_on_the_policys_devices_is_refused_in_async_mode(capsys):
    """Async GRPO scores while the policy trains: a judge cannot take turns with it."""
    from rl_algorithms import cli

    judge = (
        "+env.judged={kind: judge, config: {model: {path: /nonexistent}, "
        "rubric: 'Q {prompt} A {response}', resources: {colocated: true}}}"
    )
    args = async_grpo_args("loss_fn.use_importance_sampling_correction=true", judge)
    # A synchronous run takes it: it stops at the missing model file only (before Ray starts).
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "no such file /nonexistent" in err and "judge" not in err
    assert cli.main([*args, "grpo.async_grpo.enabled=true"]) == 2
    err = capsys.readouterr().err
    assert "env.judged's judge cannot take turns" in err
    assert "env.judged.config.resources.colocated" in err
