"""Rewards from an LLM judge (``env.<task>.kind: judge``): a generative model reads a rubric,
the prompt and the response, and its answer is parsed to a score::

    env:
      judged:
        kind: judge
        config:
          model: {path: /models/Qwen2.5-0.5B-Instruct}
          rubric: |
            Question: {prompt}
            Answer: {response}
            Reference: {ground_truth}
            Rate the answer from 0 to 10 and end with <score>N</score>.
          parse: {rule: score_in_tag, tag: score, min: 0, max: 10}
          generation: {backend: vllm}    # or hf; that backend's own keys as in generation:
          resources: {num_workers: 1, gpus_per_worker: 1}
          max_new_tokens: 256

The judge samples on a generation worker group of its own, built by the same factory as the
policy's generator (``actors.make_generator``) on a virtual cluster of its own
(``actors.start_cluster``): ``resources`` says how many workers, and whether each holds a GPU
of its own or runs on CPUs. With ``resources.colocated`` it sits on the run's own bundles
instead, one worker on each, sharing the policy's GPUs. Every sample of a step goes to the
judge in one ``generate`` call (``batch_size`` caps it), greedy by default.

The rules (``rl_envs.judging``): ``score_in_tag`` reads the number in the answer's last
``<tag>...</tag>`` (with ``min``/``max`` mapped onto [0, 1]); ``yes_probability`` reads
P(yes) / (P(yes) + P(no)) at the first generated position from the generator's most likely
first tokens (``sampling.first_token_logprobs``). A sample whose answer the rule cannot read,
or whose judge call took longer than ``timeout_s``, is marked ``unscored``: it is left out of the
loss and counted (``unparsable``, ``timeouts``: one per sample), never read as 0. The timeout is
a call's, not a sample's as in the verifier environments: one batched ``generate`` decodes its
samples together and returns them together, so there is no sample's answer to keep while
another one of the call is still running; ``batch_size: 1`` gives each sample a call of its
own, at the cost of batching (the calls run one after another). A call given up on keeps the
judge's workers busy until it ends: a later call waits for it up to ``timeout_s`` more (not on
its own clock), and past that its samples are not judged at all (``unscored``, counted as
``skipped``) rather than blamed for a timeout of the call before.

The rubric is filled in as text and then encoded, and a tokenizer encodes a special token's
string (``<|im_end|>``, say) found in text as that token: so every value the rubric inserts is
first stripped of the judge tokenizer's special-token strings, and a response cannot end the
judge's user turn and write its own verdict.

Each sample's ``answer`` (logged with the rollout's samples: ``val/samples``, ``train/samples``)
is the judge's verdict: its text and the score read from it. The first ``log_judgements`` of
every step also go to this actor's log (at INFO level).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from rl_data.types import MessageLog
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.config import ConfigModel
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn
from rl_envs.judging import ParseRule, ScoreInTag, YesProbability, render_rubric, rubric_columns
from rl_envs.judging import yes_probability as read_yes_probability
from rl_envs.metrics import OutcomeCounts, reward_metrics
from rl_envs.reward_function_env import prompt_and_completion, row_columns
from rl_models.generation.config import GenerationConfig
from rl_models.modeling.config import ModelConfig

logger = logging.getLogger(__name__)


class JudgeResources(ConfigModel):
    """Where the judge's generation workers run: a virtual cluster of their own, or the run's
    own bundles (``colocated``)."""

    # Generation workers, one bundle each; they split a batch (vLLM: each engine takes
    # generation.vllm.tensor_parallel_size of them).
    num_workers: int = Field(1, ge=1)
    # 1: each worker has a GPU of its own, none of the policy's; 0: CPU workers.
    gpus_per_worker: int = Field(0, ge=0, le=1)
    # True: one judge worker on each of the run's own bundles (the policy's GPUs), beside the
    # policy and a colocated generator, instead of a cluster of its own. It takes turns with
    # them as the generator does: awake for each judging call (vLLM wakes from sleep mode,
    # HF moves its weights onto the GPU), its memory given back after it. Not with async
    # GRPO, whose environments score while the policy trains.
    colocated: bool = False

    @model_validator(mode="after")
    def _one_placement(self) -> JudgeResources:
        given = sorted({"num_workers", "gpus_per_worker"} & self.model_fields_set)
        if self.colocated and given:
            raise ValueError(
                f"colocated: true places the judge on the run's own bundles (one worker "
                f"each); leave {' and '.join(given)} out"
            )
        return self


class JudgeEnvConfig(ConfigModel):
    # The judge: any causal LM the library loads (a local directory, or hf_config in tests).
    model: ModelConfig
    # A str.format template: {prompt}, {response} and the row's columns by name.
    rubric: str
    # How the judge's answer becomes a score.
    parse: ParseRule = Field(default_factory=ScoreInTag)
    # The judge's generator: backend hf or vllm, with that backend's keys. Its model is
    # ``model``; its max_new_tokens is the key below.
    generation: GenerationConfig = Field(default_factory=lambda: GenerationConfig(backend="hf"))
    resources: JudgeResources = Field(default_factory=JudgeResources)
    # Render the rubric as a user turn with the judge tokenizer's chat template (when it has one).
    chat_template: bool = True
    # Most tokens of the judge's answer (yes_probability reads the first one only).
    max_new_tokens: int = Field(256, ge=1)
    greedy: bool = True  # False: sample with generation.sampling
    # Samples per generate call; None: a step's whole batch in one call.
    batch_size: int | None = Field(None, ge=1)
    # Seconds a generate call may take; past it every sample of the call is unscored, each
    # counted in timeouts. Per call, not per sample: a call's samples are decoded together and
    # come back together. batch_size sets how many share a call (1: a timeout per sample).
    timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    # Judgements (prompt's end, response's start, the judge's answer) logged per step.
    log_judgements: int = Field(2, ge=0)
    # The k of the pass@k metrics reported at validation.
    pass_at_k: list[int] = [1]
    success_threshold: float = 1.0  # reward at which a sample counts as correct
    # Where this config sits in the recipe, for error messages (set by the recipe's loader).
    config_key: str = "judge"

    @field_validator("rubric")
    @classmethod
    def _readable_rubric(cls, rubric: str) -> str:
        rubric_columns(rubric)  # a ValueError naming a placeholder that is no plain name
        return rubric

    @model_validator(mode="after")
    def _one_max_new_tokens(self) -> JudgeEnvConfig:
        if "max_new_tokens" in self.generation.sampling.model_fields_set:
            raise ValueError(
                "set the judge's max_new_tokens (a key of its own), not "
                "generation.sampling.max_new_tokens"
            )
        if self.generation.model is not None:
            raise ValueError("the judge's model is its model key; leave generation.model out")
        vllm = getattr(self.generation, "vllm", None)  # the vLLM backend's keys
        if (
            self.resources.colocated
            and vllm is not None
            and "gpu_memory_utilization" not in vllm.model_fields_set
        ):
            raise ValueError(
                "a colocated vLLM judge is awake while it scores, beside what else holds those "
                "GPUs then (a colocated generator, or the policy where the generator has GPUs of "
                "its own): set generation.vllm.gpu_memory_utilization to the share it may take "
                f"(the default {vllm.gpu_memory_utilization} is for an engine alone)"
            )
        return self

    def generator_config(self) -> GenerationConfig:
        """The judge's generation config: its model, max_new_tokens, the first token's top
        log-probs for yes_probability, and workers that keep their device between calls when
        it is their own, or give it back after each call when they share the policy's."""
        top_k = self.parse.top_k if isinstance(self.parse, YesProbability) else 0
        sampling = self.generation.sampling.model_copy(
            update={"max_new_tokens": self.max_new_tokens, "first_token_logprobs": top_k}
        )
        return self.generation.model_copy(
            update={
                "model": self.model,
                "sampling": sampling,
                "colocated": self.resources.colocated,
            }
        )


@dataclass(frozen=True)
class Judgement:
    """What the judge said of one sample: its answer, the score read from it (None: no
    score), and why there is none."""

    text: str
    score: float | None
    reason: str = ""

    def summary(self) -> str:
        verdict = f"score {self.score:g}" if self.score is not None else f"no score: {self.reason}"
        return f"{verdict} | judge: {self.text}"


class OneCallAtATime:
    """Runs calls one at a time on a thread of its own, each given up on past its timeout.

    A call given up on cannot be stopped: it holds the thread (and the judge's workers) until
    it ends. The next call waits for it, up to ``timeout_s`` after it was given up on, before
    starting its own clock, so that each call's timeout measures its own work only; while the
    call given up on still runs past that, later calls are skipped at once."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="judge-call")
        self._lock = threading.Lock()  # one caller at a time: each clock starts when it runs
        self._abandoned: Future | None = None
        self._abandoned_until = 0.0

    def call(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float
    ) -> tuple[Literal["done", "timeout", "skipped"], Any]:
        """``("done", fn(*args))``; ``("timeout", None)`` when it ran past ``timeout_s``;
        ``("skipped", None)`` when a call given up on still runs and ``fn`` was not called."""
        with self._lock:
            if self._abandoned is not None:
                left = self._abandoned_until - time.monotonic()
                try:
                    self._abandoned.exception(timeout=max(left, 0.0))  # its error was given up
                except FutureTimeout:
                    return "skipped", None
                self._abandoned = None
            future = self._thread.submit(fn, *args)  # the thread is free: it starts now
            try:
                return "done", future.result(timeout=timeout_s)
            except FutureTimeout:
                self._abandoned = future
                self._abandoned_until = time.monotonic() + timeout_s
                return "timeout", None

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The strings a tokenizer encodes as control tokens wherever they appear in text: its
    special tokens and the added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    specials = {*tokenizer.all_special_tokens}
    specials |= {t.content for t in added if getattr(t, "special", False)}
    return tuple(sorted(specials))


def judge_prompt_ids(tokenizer: Any, text: str, chat_template: bool = True) -> list[int]:
    """The token ids the judge reads for a rendered rubric: a user turn of the tokenizer's chat
    template (when ``chat_template`` and it has one), else the text with the tokenizer's own
    special tokens."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)  # the template holds them
    return tokenizer.encode(text, add_special_tokens=True)


class JudgeEnvironment(EnvironmentInterface):
    """Single-turn: one score per completion from the judge. Metadata per sample: the row's
    columns, which the rubric may name."""

    @classmethod
    def required_metadata_for(cls, cfg: JudgeEnvConfig) -> tuple[str, ...]:
        return rubric_columns(cfg.rubric)

    @classmethod
    def shares_main_cluster(cls, cfg: JudgeEnvConfig) -> bool:
        """Whether the judge's workers go on the run's own cluster (``start_environments``
        hands it over; the run counts them among the groups sharing its bundles)."""
        return cfg.resources.colocated

    def __init__(self, cfg: JudgeEnvConfig, main_cluster: Any = None) -> None:
        from rl_algorithms import actors
        from rl_algorithms.config import ClusterConfig
        from rl_models.generation.hf_worker import load_tokenizer

        self.cfg = cfg
        self.required_metadata = self.required_metadata_for(cfg)  # type: ignore[misc]
        generation = cfg.generator_config()
        self.tokenizer = load_tokenizer(generation.tokenizer or cfg.model.path)
        if self.tokenizer is None:
            raise ValueError(
                f"{cfg.config_key}: the judge needs a tokenizer (in model.path or "
                "generation.tokenizer) to write its prompts and read its answers"
            )
        self.yes_ids = self.no_ids = ()
        if isinstance(cfg.parse, YesProbability):
            self.yes_ids = tuple(self._token_id(t, "yes_tokens") for t in cfg.parse.yes_tokens)
            self.no_ids = tuple(self._token_id(t, "no_tokens") for t in cfg.parse.no_tokens)
        self.owns_cluster = not cfg.resources.colocated
        if not self.owns_cluster:
            if main_cluster is None:
                raise ValueError(
                    f"{cfg.config_key}.resources.colocated: the judge shares the run's cluster, "
                    "and none was given (only a run's start_environments gives it)"
                )
            self.cluster = main_cluster
        else:
            n, gpus = cfg.resources.num_workers, cfg.resources.gpus_per_worker
            self.cluster = actors.start_cluster(
                ClusterConfig(gpus_per_node=n * gpus, cpu_workers_per_node=n),
                f"{cfg.config_key}-judge",
                bundles_per_node=[n],
            )
        try:
            self.generator = actors.make_generator(
                self.cluster, generation, cfg.model, f"{cfg.config_key}-judge"
            )
        except BaseException:
            if self.owns_cluster:
                self.cluster.shutdown()
            raise
        if not self.owns_cluster:
            self.generator.finish_generation()  # asleep until its first call: the run starts
        # One thread waits on the generator, so that a call past timeout_s can be given up on.
        self._calls = OneCallAtATime()
        self.control_strings = special_token_strings(self.tokenizer)
        self._lock = threading.Lock()
        self.counts = OutcomeCounts()
        self.unparsable = self.skipped = 0
        self.judge_seconds = 0.0

    def _token_id(self, text: str, key: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"{self.cfg.config_key}.parse.{key}: {text!r} is {len(ids)} tokens of the "
                f"judge's tokenizer ({ids}); each must be exactly one"
            )
        return ids[0]

    def _generate(self, prompts: list[list[int]]) -> BatchedDataDict:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(p) for p in prompts]))
        if self.owns_cluster:
            return self.generator.generate(data, greedy=self.cfg.greedy)
        # On the policy's devices: awake for this call only, so that training has them back.
        self.generator.prepare_for_generation()
        try:
            return self.generator.generate(data, greedy=self.cfg.greedy)
        finally:
            self.generator.finish_generation()

    def _judge(self, prompts: list[list[int]]) -> tuple[str, list[Judgement]]:
        """How the generate call on ``prompts`` went (done, timeout, skipped) and the judge's
        verdicts (for a call that did not finish, ones with no score that say why)."""
        status, out = self._calls.call(self._generate, prompts, timeout_s=self.cfg.timeout_s)
        if status != "done":
            why = (
                f"over timeout_s={self.cfg.timeout_s:g}"
                if status == "timeout"
                else "not judged: a call past timeout_s still holds the judge"
            )
            return status, [Judgement("", None, why)] * len(prompts)
        verdicts = []
        for row, prompt in enumerate(prompts):
            n, g = len(prompt), int(out["generation_lengths"][row])
            text = self.tokenizer.decode(
                out["output_ids"][row, n : n + g].tolist(), skip_special_tokens=True
            )
            if isinstance(self.cfg.parse, YesProbability):
                score, reason = read_yes_probability(
                    out["first_token_top_ids"][row].tolist(),
                    out["first_token_top_logprobs"][row].tolist(),
                    self.yes_ids,
                    self.no_ids,
                )
            else:
                score, reason = self.cfg.parse.parse(text)
            verdicts.append(Judgement(text, score, reason))
        return status, verdicts

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        n = len(message_log_batch)
        prompts = []
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True)):
            prompt, completion, _ = prompt_and_completion(log, meta)
            where = f"{self.cfg.config_key}: sample {i} of the batch"
            text = render_rubric(
                self.cfg.rubric,
                prompt,
                completion,
                row_columns(meta),
                where,
                control_strings=self.control_strings,
            )
            prompts.append(judge_prompt_ids(self.tokenizer, text, self.cfg.chat_template))
        size = self.cfg.batch_size or max(n, 1)
        verdicts: list[Judgement] = []
        statuses: list[str] = []
        start = time.monotonic()
        for s in range(0, n, size):
            status, chunk = self._judge(prompts[s : s + size])
            statuses += [status] * len(chunk)
            verdicts += chunk
        with self._lock:
            self.judge_seconds += time.monotonic() - start
            for verdict, status in zip(verdicts, statuses, strict=True):
                self.counts.add(status)  # "timeout" is counted as one, "skipped" is not
                self.skipped += status == "skipped"
                self.unparsable += verdict.score is None and status == "done"
        for i, verdict in enumerate(verdicts[: self.cfg.log_judgements]):
            logger.info("%s: sample %d: %s", self.cfg.config_key, i, verdict.summary()[:500])
        rewards = [0.0 if v.score is None else v.score for v in verdicts]
        return EnvironmentReturn(
            observations=[
                {
                    "role": "environment",
                    "content": f"reward {v.score:g}" if v.score is not None else "not scored",
                }
                for v in verdicts
            ],
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=[v.summary() for v in verdicts],
            unscored=torch.tensor([v.score is None for v in verdicts], dtype=torch.bool),
        )

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
            counts = {
                **self.counts.take(),
                "unparsable": float(self.unparsable),
                "skipped": float(self.skipped),
                "judge_seconds": self.judge_seconds,
            }
            self.unparsable, self.skipped, self.judge_seconds = 0, 0, 0.0
        return batch, {**metrics, **counts}

    def shutdown(self) -> None:
        self._calls.shutdown()
        self.generator.shutdown()
        if self.owns_cluster:  # a shared cluster is the run's to remove
            self.cluster.shutdown()
