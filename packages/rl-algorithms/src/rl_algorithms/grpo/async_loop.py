"""Asynchronous GRPO: the generator keeps sampling while the trainer trains.

    rl grpo --config examples/configs/grpo_math.yaml grpo.async_grpo.enabled=true \\
        generation.colocated=false generation.vllm.async_engine=true \\
        loss_fn.use_importance_sampling_correction=true

A trajectory collector (``collector.py``, a Ray actor) runs each prompt group's episodes
through the agent loop of sync GRPO (multi-turn, tools; ``grpo.max_rollout_turns``,
``grpo.agent_loop``) or through ``grpo.agent_program`` (programs of your own, talking to an
OpenAI-compatible endpoint the collector serves), their turns generated on the vLLM async
engine on workers of its own; it
starts a group only if the trainer can train on it within ``max_trajectory_age_steps`` steps
(staleness by admission). The trainer takes the groups with the oldest tokens from a replay
buffer (``replay_buffer.py``) and, after each step, refits the generator without waiting for
it: running episodes go on under the new weights, each token tagged with the weight version
that sampled it. One step, top to bottom (``async_grpo_train``)::

    wait for num_prompts_per_step groups (and for a running group at the last step it can be
    trained in, max_trajectory_span_steps after it was admitted; one older than that, which
    the wait rarely leaves, is dropped, counted with its tokens, and its prompt generated
    again; with dynamic sampling the collector filters groups whose
    rewards are all equal; a dead, failed, stalled or exhausted collector, or a wait past
    max_wait_seconds, raises here, naming it and the cause)
    -> advantages -> log-probs under the current policy -> clipped policy-gradient step, whose
       importance weights (generator log-probs vs the trainer's) correct for the lag
    -> refit: in flight (the engine pauses between two decoding steps, running samples go on
       with the new weights) or after draining (no generation starts from the drain to the
       end of the refit)
    -> metrics, validation, checkpoint (the buffer, the loader position and every prompt the
       collector had drawn go with it)

Shared with synchronous GRPO (``steps.py``, ``loop.py``): setup, advantages, log-probs, the
train step and the end of a step (log, validate, checkpoint).

What a resume preserves (unlike sync GRPO, whose resume is exact, async GRPO's is not: even an
uninterrupted run depends on timing -- which group finishes first, where a refit lands):

- exactly: the step, the policy's weights, optimiser state and weight version, the controller's
  RNGs, the logger's state; the replay buffer's finished groups (samples, rewards, generator
  log-probs, weight versions, and the step each was generated at, so their ages go on counting
  from it) and its dropped-group counters;
- every prompt, none lost and none doubled: a prompt drawn before the checkpoint was trained
  on before it, is a finished group in the saved buffer, or is *pending* (queued, being
  submitted, generating, or being scored) -- pending prompts are generated again, first, by
  the resumed collector, and the loader goes on after the last prompt drawn;
- lost: episodes in flight, whole -- the turns they had finished (tokens and environment
  replies) and the turn being generated; their prompts start again from scratch, first, with
  the resumed weights; the collector's counters (``requeued_groups``, ``aborted_groups``,
  ``stale_requeued_groups``, ``filtered_groups``, generated and discarded tokens,
  ``generator_idle_seconds``, which restart at 0), and the engines' random state: streams
  carry no per-row seeds (``rl_models.generation.seeds``), so a prompt generated again draws
  other samples than it would have. A group finished before the checkpoint is never lost: it
  is in the saved buffer (``Trajectories.state_dict`` pulls every finished group first).
"""

from __future__ import annotations

import time
from typing import Any

from rl_algorithms.diagnostics import warn_on_mismatch
from rl_algorithms.grpo.collector_client import CollectorClient, CollectorError
from rl_algorithms.grpo.collector_reply import CollectorReply
from rl_algorithms.grpo.replay_buffer import ReplayBuffer, TrajectoryGroup
from rl_algorithms.grpo.steps import (
    refit_if_stale,
    response_length,
    train_on_rollouts,
    validate,
)
from rl_algorithms.rollouts import RolloutResult, take_environment_counts
from rl_algorithms.run import Run, end_step, start_loop
from rl_envs.reward_functions import resolve_reference

COLLECTOR_NAME = "grpo-trajectory-collector"


def start_collector(run: Run, buffer: ReplayBuffer, state: dict[str, Any]) -> CollectorClient:
    """The collector on the generator's streaming engines, the environments and the prompt
    loader (at the checkpoint's position, with the prompts it had drawn queued first)."""
    g, a = run.config.grpo, run.config.grpo.async_grpo
    program, sampling = g.agent_program, run.config.generation.sampling
    if program is not None and program.function is not None:  # (loaded in the collector's
        # process, which need not share this one's working directory)
        program = program.model_copy(update={"function": resolve_reference(program.function)})
    ahead = a.max_groups_ahead or g.num_prompts_per_step * (a.max_trajectory_age_steps + 1)
    return CollectorClient(
        COLLECTOR_NAME,
        run.generation.streaming_samplers(call_timeout=a.engine_call_seconds),
        run.generation.pad_token_id,
        run.tokenizer,
        run.template,
        run.envs,
        run.train_loader,
        group_size=g.num_generations_per_prompt,
        max_seq_len=run.config.policy.max_total_sequence_length,
        max_epochs=g.max_num_epochs,
        max_group_seconds=a.max_group_seconds,
        max_groups_ahead=max(ahead, g.num_prompts_per_step),
        prompts_per_step=g.num_prompts_per_step,
        max_age_steps=a.max_trajectory_age_steps,
        in_flight_weight_updates=a.in_flight_weight_updates,
        max_turns=g.max_rollout_turns,
        agent_loop=g.agent_loop,
        dynamic_sampling=g.use_dynamic_sampling,
        agent_program=program,
        sampling=(sampling.temperature, sampling.top_p),
        engine_call_seconds=a.engine_call_seconds,
        pending_prompts=state.get("pending_prompts"),
        groups_out=len(buffer),
    )


class Trajectories:
    """The trainer's side of the buffer: pulls from the collector, hands it back the prompts
    of stale groups, counts what it waited."""

    def __init__(self, buffer: ReplayBuffer, collector: CollectorClient, max_wait: float) -> None:
        self.buffer = buffer
        self.collector = collector
        self.max_wait = max_wait
        self.consumed = 0  # groups trained on or dropped, as the collector counts them
        self.last_reply: CollectorReply | None = None  # the collector's latest, see ``pull``
        # 1 from taking a step's groups until the next ``take``: the generator's weights are
        # then a step behind the groups still to come (the collector admits fewer).
        self.lag = 0
        # Steps held up by a group at its last chance while the buffer held enough groups.
        self.straggler_waits = 0

    @classmethod
    def start(cls, run: Run) -> Trajectories:
        """The buffer (restored from a checkpoint, if any) and the collector of ``run``."""
        a = run.config.grpo.async_grpo
        buffer = ReplayBuffer(a.max_trajectory_span_steps)
        state = run.extra.get("async_grpo", {})
        if "buffer" in state:
            buffer.load_state_dict(state["buffer"])
        collector = start_collector(run, buffer, state.get("collector", {}))
        return cls(buffer, collector, a.max_wait_seconds)

    def pull(self, timeout: float) -> None:
        """Hand the collector the stale groups' prompts and what was consumed; add what it
        finished to the buffer."""
        stale = [(group.prompt, group.requeues) for group in self.buffer.pop_stale()]
        self.last_reply = self.collector.take(self.consumed, timeout, stale, self.lag)
        self.buffer.add(self.last_reply.groups)

    def take(self, n: int, step: int) -> tuple[list[TrajectoryGroup], float]:
        """``n`` groups young enough for ``step``, and the seconds spent waiting for them.

        A running group whose tokens may date from ``max_trajectory_span_steps`` steps ago
        would be too old to train on after this step, and dropped: so the step waits until it
        is in the buffer (or was cut at ``max_group_seconds``), where the oldest groups are
        taken first. (More than ``n`` groups due at once cannot all be taken: the extras are
        dropped as before.)"""
        start = time.monotonic()
        if self.last_reply is not None:
            # The collector's state now, not as it was before training. (Sent at the last
            # step's lag: running out of prompts is no error while the buffer may hold this
            # step's groups.)
            self.pull(timeout=0)
        self.lag = 0
        waited_for_straggler = False
        while True:
            dropped = self.buffer.dropped_groups
            straggler = self._straggler_due(step)
            # Counted only while the buffer could serve the step: then the straggler alone
            # holds it up (short of groups, the step would wait anyway).
            waited_for_straggler |= straggler and self.buffer.holds(n, step)
            groups = None if straggler else self.buffer.take(n, step)
            self.consumed += self.buffer.dropped_groups - dropped
            if groups is not None:
                self.consumed += n
                waited = time.monotonic() - start
                self.straggler_waits += waited_for_straggler
                self.lag = 1
                self.pull(timeout=0)  # tell the collector at once: it may start more groups
                return groups, waited
            waited = time.monotonic() - start
            if waited > self.max_wait:
                raise CollectorError(
                    f"waited {waited:.0f} s (grpo.async_grpo.max_wait_seconds) for {n} groups "
                    f"from the {self.collector.describe()}; the buffer holds {len(self.buffer)}"
                )
            self.pull(timeout=1.0)

    def _straggler_due(self, step: int) -> bool:
        """Whether a running group may hold tokens ``max_trajectory_span_steps`` steps old at
        ``step``: this is the last step it can be trained in. (A group past it is too old
        whenever it comes: waiting for it would only hold the step up. With a span equal to
        ``max_trajectory_age_steps`` every step waits for the groups of the last one.)"""
        reply = self.last_reply
        if reply is None:
            return False
        span = self.buffer.max_age_steps
        return any(step - self.buffer.step_of(v) == span for v in reply.running_versions)

    def state_dict(self) -> dict[str, Any]:
        self.pull(timeout=0)  # what finished is saved rather than generated again
        return {"buffer": self.buffer.state_dict(), "collector": self.collector.state_dict()}


def refit_generator(run: Run, trajectories: Trajectories) -> dict[str, float]:
    """The new weights onto the generator: in flight, or after the running groups finish."""
    a = run.config.grpo.async_grpo
    if a.in_flight_weight_updates:
        return refit_if_stale(run)
    collector = trajectories.collector
    drained = collector.drain(a.max_group_seconds + 30)
    if not drained:
        trajectories.pull(timeout=0)  # raises the collector's own error, if it has one
        raise CollectorError(f"the {collector.describe()} did not drain its running groups")
    try:
        return refit_if_stale(run)
    finally:
        collector.resume()


def validate_paused(run: Run, trajectories: Trajectories) -> dict[str, float]:
    """``validate`` with the collector paused: the environments' counts are running sums
    since their last metrics call, and a training group scored while validation runs would
    land in validation's. So generation and scoring stop first; what the environments counted
    between this step's metrics and the pause (a few groups at most) is taken and dropped, as
    it belongs to no step's batch; the collector resumes after validation."""
    if run.val_loader is None:
        return {}
    a = run.config.grpo.async_grpo
    collector = trajectories.collector
    paused = collector.drain(a.max_group_seconds + 30, scoring=True)
    try:
        if not paused:
            trajectories.pull(timeout=0)  # raises the collector's own error, if it has one
            raise CollectorError(f"the {collector.describe()} did not pause for validation")
        take_environment_counts(run.envs)
        return validate(run)
    finally:
        collector.resume()


def trajectory_metrics(
    buffer: ReplayBuffer, groups: list[TrajectoryGroup], step: int
) -> dict[str, float]:
    """The age histogram of the samples trained on, and how many saw a weight update."""
    histogram = buffer.age_histogram(groups, step)
    samples = sum(histogram.values())
    metrics = {f"trajectory_age/count_{age}": float(n) for age, n in histogram.items()}
    metrics["trajectory_age/max"] = float(max(histogram))
    metrics["trajectory_age/mean"] = sum(age * n for age, n in histogram.items()) / samples
    metrics["inflight_updated_samples"] = float(
        sum(int((g.version_max > g.version_min).sum()) for g in groups)
    )
    metrics["group_seconds_mean"] = sum(g.seconds for g in groups) / len(groups)
    return metrics


def discarded_token_fraction(
    buffer: ReplayBuffer, dropped_at_start: int, reply: CollectorReply
) -> float:
    """Tokens of groups dropped as too old, cancelled or aborted over every token generated
    for training, both since this process started: the collector's counts restart at 0 on a
    resume, the buffer's (checkpointed) ``dropped_tokens`` does not, so its count at the start
    (``dropped_at_start``) is left out."""
    discarded = buffer.dropped_tokens - dropped_at_start + reply.discarded_tokens
    return discarded / max(reply.generated_tokens, 1)


def async_grpo_train(run: Run) -> dict[str, float]:
    """Train for ``grpo.max_num_steps`` steps on groups from the collector."""
    g, timer = run.config.grpo, run.logger.timer
    refit_if_stale(run)  # a resumed policy's weights onto the generator before it samples
    trajectories = Trajectories.start(run)
    buffer = trajectories.buffer
    dropped_at_start = buffer.dropped_tokens  # (a resumed buffer's, see discarded_token_fraction)
    buffer.record_step(run.step, run.policy.weight_version)
    if len(buffer):
        run.logger.log_metrics({"restored_buffer_groups": float(len(buffer))}, run.step, "run")
    last: dict[str, float] = {}
    idle_before = 0.0

    def save_collector_state() -> None:
        """The buffer, the collector's loader position and the prompts it had drawn (queued
        first again on resume) go into the checkpoint."""
        state = trajectories.state_dict()
        run.train_loader.load_state_dict(state["collector"]["loader"])
        run.extra["async_grpo"] = state

    try:
        start_loop(run, lambda: validate_paused(run, trajectories), g.val_at_start)
        while run.step < run.total_steps:
            groups, trainer_idle = trajectories.take(g.num_prompts_per_step, run.step)
            age_metrics = trajectory_metrics(buffer, groups, run.step)
            result = RolloutResult.concat([group.result for group in groups])
            step_metrics = train_on_rollouts(run, result)
            # The environments' metrics of this batch: accuracy and pass@k of the groups
            # trained on; their counts (samples, timeouts, per-function values) cover every
            # group they scored since the last step, the collector scoring ahead of the trainer.
            env_metrics = result.environment_metrics(run.envs)
            run.step += 1
            with timer("refit"):
                refit_metrics = refit_generator(run, trajectories)
            buffer.record_step(run.step, run.policy.weight_version)

            reply = trajectories.last_reply
            assert reply is not None  # ``take`` pulls from the collector before it returns
            generator_idle = reply.generator_idle_seconds
            lengths = [response_length(log) for log in result.message_logs]
            last = {
                **step_metrics,
                **env_metrics,
                **refit_metrics,
                **age_metrics,
                "mean_generated_tokens": sum(lengths) / len(lengths),
                "truncated_fraction": float(result.truncated.double().mean()),
                "buffer_size": float(len(buffer)),
                "dropped_groups": float(buffer.dropped_groups),
                "dropped_samples": float(buffer.dropped_samples),
                "filtered_groups": float(reply.filtered_groups),
                # Finished-but-discarded work (0 on a healthy run).
                "discarded_token_fraction": discarded_token_fraction(
                    buffer, dropped_at_start, reply
                ),
                "requeued_groups": float(reply.requeued_groups),
                # Steps that waited for a long group rather than let it grow too old.
                "straggler_waits": float(trajectories.straggler_waits),
                "aborted_groups": float(reply.aborted_groups),
                # Cancelled groups whose agent loop is still blocked in an environment step
                # (no env_step_timeout_s): each holds a thread.
                "stuck_groups": float(reply.stuck_groups),
                "stale_requeued_groups": float(reply.stale_requeued_groups),
                "trainer_idle_seconds": trainer_idle,
                "generator_idle_seconds": generator_idle - idle_before,
            }
            idle_before = generator_idle
            if g.agent_program is not None:  # what the programs of the groups trained on did
                from rl_algorithms.agent_programs.programs import program_metrics

                last.update(program_metrics(result.end_reasons, result.turns.tolist()))
            last.update(warn_on_mismatch(run, last))
            end_step(
                run,
                last,
                lambda: validate_paused(run, trajectories),
                before_checkpoint=save_collector_state,
            )
    finally:
        trajectories.collector.stop()
        run.logger.progress.stop()
    return last
