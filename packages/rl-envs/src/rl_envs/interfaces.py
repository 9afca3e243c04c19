"""What every environment offers: ``step`` a batch of conversations, and batch-level metrics.

Environments are plain classes so that they can be tested in-process; in a run each one is a
Ray actor (:meth:`EnvironmentInterface.as_actor`) beside the policy and generation actors.

An actor serves one call at a time, unless its class declares ``concurrent_steps``: then its
``step`` is safe to call from several threads at once (shared state under a lock, the slow work
outside it), its actor serves up to ``MAX_CONCURRENT_STEPS`` calls at once, and the agent loop
steps each of its episodes on a call of its own (``env_steps: auto``), so that an episode goes
on as soon as its own step returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import ray
import torch

from rl_data.array_pickling import reduce_with_arrays, shallow_copy
from rl_data.types import Message, MessageLog

#: The step calls an environment actor of ``concurrent_steps`` serves at once (Ray's
#: ``max_concurrency``: a thread each). A step mostly waits on its worker pools, so threads are
#: cheap; calls beyond them wait in the actor's queue.
MAX_CONCURRENT_STEPS = 128


@dataclass(frozen=True)
class RewardComponents:
    """The separate rewards a reward is the weighted sum of, kept apart for estimators that
    normalise each on its own (GDPO, ``grpo.advantage_estimator: gdpo``).

    ``values[..., k]`` is reward ``names[k]``, whose weight in the sum is ``weights[k]``: ``[B,
    K]`` in an ``EnvironmentReturn`` (and, stacked over a rollout's samples, in a
    ``RolloutResult``), ``[K]`` in one sample's ``EnvironmentStep``. A reward the environment
    has no value for is 0, as it counts in the sum.
    """

    names: tuple[str, ...]
    weights: tuple[float, ...]
    values: torch.Tensor  # float32 [..., K]

    def __post_init__(self) -> None:
        k = len(self.names)
        if k == 0 or len(self.weights) != k or self.values.dim() == 0 or self.values.shape[-1] != k:
            raise ValueError(
                f"RewardComponents: {k} names, {len(self.weights)} weights and values of shape "
                f"{tuple(self.values.shape)} (the last dimension must be the number of names, >= 1)"
            )
        if len(set(self.names)) != k:
            raise ValueError(f"RewardComponents: names repeat: {list(self.names)}")

    def __reduce__(self) -> tuple[Any, ...]:  # its tensor crosses processes as an array
        return reduce_with_arrays(self)

    def __copy__(self) -> RewardComponents:
        return shallow_copy(self)

    def __getitem__(self, rows: Any) -> RewardComponents:
        """The same rewards for these rows of ``values``."""
        return RewardComponents(self.names, self.weights, self.values[rows])

    def same_rewards(self, other: RewardComponents | None) -> bool:
        """Whether ``other`` holds the same rewards (names and weights): the values of the two
        can be stacked or added."""
        return other is not None and (self.names, self.weights) == (other.names, other.weights)

    def combined(self) -> torch.Tensor:
        """The weighted sum of the rewards, ``[...]`` (float64)."""
        weights = torch.tensor(self.weights, dtype=torch.float64)
        return (self.values.to(torch.float64) * weights).sum(-1)


# An environment's reply to one sample's turn: one message, or several (a tool environment
# answers each of the turn's tool calls with its own ``role: tool`` message).
Observation = Message | list[Message]


@dataclass(frozen=True)
class EnvironmentStep:
    """One sample's share of an ``EnvironmentReturn``."""

    observation: Observation  # the environment's reply, appended to the conversation
    metadata: dict[str, Any] | None  # passed back in on the next step (multi-turn state)
    next_stop_strings: list[str] | None  # for the next generation; None: the default
    reward: float
    terminated: bool  # the episode is over
    answer: str | None  # what was extracted from the response and scored, for logging
    # The reward's components ([K] values), when the environment keeps them apart.
    reward_components: RewardComponents | None = None
    # The environment could not score this sample (a reward server that never answered): its
    # reward says nothing of the response, so the episode ends and stays out of the loss.
    unscored: bool = False

    @property
    def messages(self) -> list[Message]:
        """The reply as the messages to append, in order."""
        return list(self.observation) if isinstance(self.observation, list) else [self.observation]


class EnvironmentReturn(NamedTuple):
    """One ``step`` over a batch of B conversations; every field has one entry per sample."""

    observations: list[Observation]  # the environment's reply, appended to each conversation
    metadata: list[dict[str, Any] | None]  # passed back in on the next step (multi-turn state)
    next_stop_strings: list[list[str] | None]  # for the next generation; None: the default
    rewards: torch.Tensor  # float32 [B]
    terminateds: torch.Tensor  # bool [B]: the episode is over
    answers: list[str | None]  # what was extracted from the response and scored, for logging
    # The separate rewards ([B, K]) that ``rewards`` is the weighted sum of; None for an
    # environment with a single reward (or one that does not keep them apart).
    reward_components: RewardComponents | None = None
    # bool [B]: the samples the environment could not score (see ``EnvironmentStep``); None:
    # it scored every one.
    unscored: torch.Tensor | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # from an actor, its tensors travel as arrays
        return reduce_with_arrays(self)

    def __copy__(self) -> EnvironmentReturn:
        return shallow_copy(self)

    def steps(self) -> list[EnvironmentStep]:
        """Each sample's step, in the batch's order."""
        per_sample = self._asdict()
        components = per_sample.pop("reward_components")
        unscored = per_sample.pop("unscored")
        lengths = {name: len(value) for name, value in per_sample.items()}
        if components is not None:
            lengths["reward_components"] = len(components.values)
        if unscored is not None:
            lengths["unscored"] = len(unscored)
        if len(set(lengths.values())) > 1:
            raise ValueError(f"an EnvironmentReturn's fields differ in length: {lengths}")
        return [
            EnvironmentStep(
                obs,
                meta,
                stops,
                float(reward),
                bool(done),
                answer,
                None if components is None else components[i],
                unscored is not None and bool(unscored[i]),
            )
            for i, (obs, meta, stops, reward, done, answer) in enumerate(
                zip(*per_sample.values(), strict=True)
            )
        ]


class EnvironmentInterface(ABC):
    # Columns of a sample's metadata (the row's extra_env_info) the reward cannot do without.
    # Setup checks the data against them (rl_data.datasets.require_env_info), and ``step``
    # refuses a sample without them rather than scoring it 0.
    required_metadata: ClassVar[tuple[str, ...]] = ()
    # Whether ``step`` returns ``EnvironmentReturn.reward_components`` (the separate rewards
    # its reward sums): GDPO (grpo.advantage_estimator: gdpo) refuses environments without.
    returns_reward_components: ClassVar[bool] = False
    # Whether ``step`` may run in several threads at once: its shared state (counters, metrics)
    # under a lock, its slow work (tool calls, verifiers) outside it. Its actor then serves
    # ``MAX_CONCURRENT_STEPS`` calls at once, and the agent loop steps each episode on its own
    # call by default (``env_steps: auto``). False: one call at a time, episodes batched.
    concurrent_steps: ClassVar[bool] = False

    @classmethod
    def required_metadata_for(cls, cfg: Any) -> tuple[str, ...]:
        """``required_metadata`` of the environment ``cfg`` configures (setup checks rows
        against it); environments whose columns depend on their config override this."""
        return cls.required_metadata

    @classmethod
    def offered_tools_for(cls, cfg: Any) -> list[dict[str, Any]] | None:
        """The tools (OpenAI function schemas) a prompt of this environment is offered when its
        row has no ``tools`` column: the prompt is rendered with them, so that the model knows
        what it may call. None: an environment without tools."""
        return None

    @abstractmethod
    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Score the latest assistant turn of each conversation and say what comes next."""

    @abstractmethod
    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        """Metrics over a whole (rolled-out) batch: ``batch["rewards"]`` [B] and, optionally,
        ``batch["group_ids"]`` [B] (samples of the same prompt share an id, for pass@k)."""

    def shutdown(self) -> None:  # noqa: B027 - optional: only pooled environments own resources
        """Release workers and processes; the environment is unusable afterwards."""

    def serves_concurrent_steps(self) -> bool:
        """``concurrent_steps``, for a caller that holds this environment's Ray actor (which
        answers method calls only)."""
        return type(self).concurrent_steps

    @classmethod
    def as_actor(cls, cfg: Any, *args: Any, **actor_options: Any) -> ray.actor.ActorHandle:
        """Start this environment as a Ray actor, built as ``cls(cfg, *args)``. It mostly waits
        on its workers, so by default it reserves no CPU of its own (``num_cpus=0``); one of
        ``concurrent_steps`` serves ``MAX_CONCURRENT_STEPS`` calls at once (a threaded
        actor)."""
        options: dict[str, Any] = {"num_cpus": 0}
        if cls.concurrent_steps:
            options["max_concurrency"] = MAX_CONCURRENT_STEPS
        return ray.remote(cls).options(**{**options, **actor_options}).remote(cfg, *args)


def check_required_metadata(
    env: EnvironmentInterface, metadata: list[dict[str, Any] | None]
) -> None:
    """A ``ValueError`` naming the first sample (its index in the batch) and column of
    ``env.required_metadata`` that its metadata lacks."""
    for i, meta in enumerate(metadata):
        missing = [k for k in env.required_metadata if k not in (meta or {})]
        if missing:
            raise ValueError(
                f"{type(env).__name__}: sample {i} of the batch has no {missing[0]!r} in its "
                f"metadata (it has {sorted(meta or {})}): the dataset's rows need that column "
                f"(rename theirs with the data source's columns: {{<name>: {missing[0]}}})"
            )


def last_assistant_text(message_log: MessageLog) -> str:
    """The content of the last assistant message ("" when there is none)."""
    for message in reversed(message_log):
        if message["role"] == "assistant":
            return message["content"]
    return ""
