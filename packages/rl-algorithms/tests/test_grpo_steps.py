"""GRPO's steps without Ray: dynamic sampling refills, advantages and masks go into the batch."""

from collections import defaultdict

import pytest
import torch

from rl_algorithms import grpo
from rl_algorithms.advantages import grpo_advantages
from rl_algorithms.run import Run
from rl_algorithms.utils.logger import Logger, LoggerConfig
from rl_data.collate import rl_collate
from rl_data.loader import StatefulDataLoader
from rl_envs.sliding_puzzle import SlidingPuzzleEnvironment
from rl_models.interfaces import TrainResult

from .test_rollouts import ScriptedGeneration, puzzle_datums


class CyclingGeneration(ScriptedGeneration):
    """Sample k's n-th response over all calls is ``script[k][n % len]``: the G copies of one
    prompt can answer differently."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.seen = defaultdict(int)

    def reply_for(self, sample, turn):
        replies = self.script[sample]
        self.seen[sample] += 1
        return replies[(self.seen[sample] - 1) % len(replies)]


def solved_reply():
    return "<action>right</action>"


SCRIPT = {0: [solved_reply(), "no"], 1: ["no"], 2: [solved_reply()]}


@pytest.fixture
def make_run(tokenizer, template, tmp_path):
    def make(samples, **grpo_overrides):
        datums = puzzle_datums(tokenizer, template, samples)
        config = grpo.MasterConfig.model_validate(
            {
                "policy": {
                    "model": {"hf_config": {"model_type": "llama"}},
                    "train_global_batch_size": 4,
                    "max_total_sequence_length": 512,
                },
                "tokenizer": {"path": str(tmp_path)},
                "generation": {"backend": "hf"},
                "loss_fn": {"reference_policy_kl_penalty": 0.0},
                "env": {"puzzle": {"kind": "sliding_puzzle"}},
                "data": {"train": {"source": "arithmetic"}},
                "grpo": {
                    "num_prompts_per_step": 2,
                    "num_generations_per_prompt": 2,
                    "max_num_steps": 1,
                    **grpo_overrides,
                },
            }
        )
        loader = StatefulDataLoader(
            datums, 2, lambda b: rl_collate(b, tokenizer.pad_token_id), shuffle=False
        )
        return Run(
            name="grpo",
            config=config,
            policy=type("P", (), {"weight_version": 0, "config": config.policy})(),
            generation=CyclingGeneration(tokenizer, SCRIPT),
            clusters=[],
            envs={"puzzle": SlidingPuzzleEnvironment()},
            tokenizer=tokenizer,
            template=template,
            train_loader=loader,
            val_loader=None,
            logger=Logger(LoggerConfig(log_dir=str(tmp_path / "logs"), progress_bar=False)),
            checkpointer=None,
            total_steps=1,
        )

    return make


def test_dynamic_sampling_refills_with_groups_that_carry_a_signal(make_run):
    run = make_run((0, 1, 2, 0), use_dynamic_sampling=True)
    result, metrics = grpo.generate_rollouts(run)
    # round 1: prompts 0 (rewards 1, 0: kept) and 1 (0, 0: set aside); round 2: prompts 2
    # (1, 1: set aside) and 0 (kept): two groups with a signal after two rounds.
    assert metrics["generation_rounds"] == 2.0
    assert result.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics["dynamic_sampling/groups_with_signal"] == 2.0


def test_dynamic_sampling_stops_at_its_round_limit_and_fills_up(make_run):
    run = make_run((0, 1, 2, 0), use_dynamic_sampling=True, dynamic_sampling_max_gen_batches=1)
    result, metrics = grpo.generate_rollouts(run)
    assert metrics["generation_rounds"] == 1.0
    assert metrics["dynamic_sampling/groups_with_signal"] == 1.0
    assert result.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]  # group 0, then set-aside group 1
    assert result.filler.tolist() == [False, False, True, True]
    batch = result.training_batch(run.tokenizer.pad_token_id)
    fields, _ = grpo.compute_advantages(run, result, batch.loss_mask)
    per_row = (fields["advantages"] * batch.loss_mask).sum(1)
    assert per_row[2:].abs().sum() == 0  # the filler group adds no gradient
    # and counts nowhere: neither in the loss's token divisor nor in its KL term
    assert fields["sample_mask"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_without_dynamic_sampling_one_round_is_trained(make_run):
    run = make_run((1, 2))
    result, metrics = grpo.generate_rollouts(run)
    assert metrics["generation_rounds"] == 1.0
    assert result.rewards.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_advantages_sit_on_the_sampled_tokens_and_truncated_samples_drop_out(make_run):
    run = make_run((0, 1), overlong_filtering=True, use_leave_one_out_baseline=True)
    result, _ = grpo.generate_rollouts(run)
    result.truncated[3] = True  # as if sample 3 had hit the length limit
    batch = result.training_batch(run.tokenizer.pad_token_id)
    fields, metrics = grpo.compute_advantages(run, result, batch.loss_mask)
    expected = grpo_advantages(result.rewards, 2, leave_one_out=True)
    torch.testing.assert_close(fields["advantages"], (expected[:, None] * batch.loss_mask).float())
    assert fields["sample_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert metrics["reward_mean"] == pytest.approx(float(result.rewards.mean()))


def test_an_unscored_sample_moves_no_other_samples_advantage(make_run):
    run = make_run((0, 1))
    result, _ = grpo.generate_rollouts(run)
    result.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    result.end_reasons = list(result.end_reasons)
    batch = result.training_batch(run.tokenizer.pad_token_id)
    before, _ = grpo.compute_advantages(run, result, batch.loss_mask)
    result.end_reasons[3] = "unscored"  # its 1.0 is a placeholder, not a reward
    after, _ = grpo.compute_advantages(run, result, batch.loss_mask)
    assert after["sample_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]
    torch.testing.assert_close(after["advantages"][:2], before["advantages"][:2])
    # Group 1 has one scored sample left: no baseline, no signal.
    assert after["advantages"][2:].abs().sum() == 0


def test_overlong_reward_shaping_penalises_long_responses(make_run):
    run = make_run(
        (0, 1),
        reward_shaping={
            "enabled": True,
            "max_response_length": 5,
            "overlong_buffer_length": 2,
        },
    )
    result, _ = grpo.generate_rollouts(run)
    lengths = [grpo.response_length(log) for log in result.message_logs]
    shaped = grpo.shaped_rewards(run, result)
    for r, s, n in zip(result.rewards.tolist(), shaped.tolist(), lengths, strict=True):
        assert s == pytest.approx(r + max(-1.0, min(0.0, (3 - n) / 2)))
    # "no" + EOS (3 tokens) is within the budget; the action answers are past it.
    penalties = sorted(
        {round(s - r, 6) for r, s in zip(result.rewards.tolist(), shaped.tolist(), strict=True)}
    )
    assert penalties == [-1.0, 0.0], (lengths, penalties)


def test_reward_scaling_clamps_then_maps_before_shaping(make_run):
    scaling = {"enabled": True, "source_min": 0.25, "source_max": 0.75}
    scaling |= {"target_min": -1.0, "target_max": 3.0}
    shaping = {"enabled": True, "max_response_length": 5, "overlong_buffer_length": 2}
    run = make_run((0, 1), reward_scaling=scaling, reward_shaping=shaping)
    result, _ = grpo.generate_rollouts(run)
    result.rewards = torch.tensor([0.0, 0.5, 1.0, 0.6])  # below, inside, above the source range
    lengths = [grpo.response_length(log) for log in result.message_logs]
    penalty = [max(-1.0, min(0.0, (3 - n) / 2)) for n in lengths]
    # 0 clamps to 0.25 -> -1; 0.5 is the middle -> 1; 1 clamps to 0.75 -> 3; 0.6 -> 1.8
    expected = [m + p for m, p in zip([-1.0, 1.0, 3.0, 1.8], penalty, strict=True)]
    assert grpo.shaped_rewards(run, result).tolist() == pytest.approx(expected)


def test_reward_scaling_needs_a_source_interval():
    with pytest.raises(ValueError, match=r"source_max \(0.0\) must be greater"):
        grpo.MasterConfig.model_validate(
            minimal_config(grpo={"reward_scaling": {"enabled": True, "source_max": 0.0}})
        )


def minimal_config(**sections) -> dict:
    config = {
        "policy": {
            "model": {"hf_config": {"model_type": "llama"}},
            "train_global_batch_size": 4,
            "max_total_sequence_length": 64,
        },
        "tokenizer": {"path": "/tok"},
        "generation": {"backend": "hf", "sampling": {"temperature": 0.7}},
        "env": {"arithmetic": {"kind": "math"}},
        "data": {"train": {"source": "arithmetic"}},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": 1},
    }
    for name, value in sections.items():
        config[name] = {**config[name], **value}
    return config


def test_the_trainer_scores_at_the_generation_temperature_with_the_generators_tokenizer():
    config = grpo.MasterConfig.model_validate(minimal_config())
    assert config.policy.logprob_temperature == 0.7
    assert config.generation.tokenizer == "/tok"
    assert config.generation.seed == config.policy.seed  # same initial weights
    assert "max_total_sequence_length" not in config.policy.worker_config().model_dump()
    assert "num_workers" not in config.generation.engine_config().model_dump()


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"loss_fn": {"reference_policy_kl_penalty": 0.1}}, "reference_policy.enabled"),
        ({"policy": {"train_global_batch_size": 3}}, "train_global_batch_size"),
        ({"generation": {"backend": "vllm"}}, "policy.model.path"),
        ({"policy": {"logprob_temperature": 0.5}}, "logprob_temperature"),
        (  # refused with the config, not at the first step's reward shaping
            {"grpo": {"reward_shaping": {"enabled": True, "max_response_length": 64}}},
            "overlong_buffer_length",
        ),
        (  # GRPO's one advantage per sample has no per-token returns to fold the KL into
            {
                "loss_fn": {"reference_policy_kl_penalty": 0.1, "use_kl_in_reward": True},
                "policy": {"reference_policy": {"enabled": True}},
            },
            "loss_fn.use_kl_in_reward: true needs grpo.advantage_estimator",
        ),
        (
            {
                "loss_fn": {"reference_policy_kl_penalty": 0.0, "use_kl_in_reward": True},
                "grpo": {"advantage_estimator": "reinforce_plus_plus"},
            },
            "folds loss_fn.reference_policy_kl_penalty",
        ),
    ],
)
def test_inconsistent_sections_are_refused_naming_the_keys(sections, named):
    config = minimal_config(**{k: v for k, v in sections.items() if k != "loss_fn"})
    if "loss_fn" in sections:
        config["loss_fn"] = sections["loss_fn"]
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        grpo.MasterConfig.model_validate(config)


class CountingPolicy:
    """Records which log-prob passes the loop asks the policy for."""

    weight_version = 0

    def __init__(self):
        self.calls = []

    def prepare_for_lp_inference(self):
        pass

    def get_logprobs(self, batch, *, at_loss_tokens=False):
        assert at_loss_tokens  # all a loss or KL reads: the prompt is not computed
        self.calls.append("policy")
        return {"logprobs": torch.zeros_like(batch.input_ids, dtype=torch.float32)}

    def get_reference_policy_logprobs(self, batch, *, at_loss_tokens=False):
        assert at_loss_tokens
        self.calls.append("reference")
        return {"reference_logprobs": torch.zeros_like(batch.input_ids, dtype=torch.float32)}


@pytest.mark.parametrize(
    ("global_batch", "kl", "expected_calls", "pi_old_in_batch"),
    [
        (4, 0.0, [], False),  # one optimiser step per batch: the train step's forward is pi_old
        (4, 0.1, ["reference"], False),
        (2, 0.0, ["policy"], True),  # two steps: pi_old must be taken before the first
        (2, 0.1, ["policy", "reference"], True),
    ],
)
def test_the_pi_old_pass_runs_only_when_a_batch_gets_several_optimiser_steps(
    make_run, global_batch, kl, expected_calls, pi_old_in_batch
):
    run = make_run((0, 1))
    config = run.config.model_dump()
    config["policy"]["train_global_batch_size"] = global_batch
    config["loss_fn"]["reference_policy_kl_penalty"] = kl
    config["policy"]["reference_policy"] = {"enabled": kl > 0}
    run.config = grpo.MasterConfig.model_validate(config)
    run.policy = CountingPolicy()
    result, _ = grpo.generate_rollouts(run)
    batch = result.training_batch(run.tokenizer.pad_token_id)
    fields = grpo.compute_logprobs(run, batch)
    assert run.policy.calls == expected_calls
    assert ("prev_logprobs" in fields) == pi_old_in_batch
    assert set(fields) == grpo.steps.logprob_fields(run.config)
    assert grpo.single_update_per_batch(run.config) == (global_batch == 4)


def test_zero_variance_groups_fraction_counts_groups_whose_rewards_are_all_equal(make_run):
    run = make_run((0, 1))
    result, _ = grpo.generate_rollouts(run)
    assert result.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]  # group 0 differs, group 1 does not
    batch = result.training_batch(run.tokenizer.pad_token_id)
    _, metrics = grpo.compute_advantages(run, result, batch.loss_mask)
    assert metrics["zero_variance_groups_fraction"] == 0.5


def advantages_warnings(run, result, steps):
    """The warnings ``compute_advantages`` raises over ``steps`` calls on ``result``."""
    import warnings

    batch = result.training_batch(run.tokenizer.pad_token_id)
    caught = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            grpo.compute_advantages(run, result, batch.loss_mask)
        caught.append([str(r.message) for r in records if r.category is RuntimeWarning])
    return caught


def test_identical_rewards_for_n_steps_warn_once_naming_likely_causes(make_run):
    run = make_run((1, 1), no_signal_warning_steps=3)
    result, _ = grpo.generate_rollouts(run)
    assert result.rewards.tolist() == [0.0, 0.0, 0.0, 0.0]
    caught = advantages_warnings(run, result, steps=5)
    assert [len(c) for c in caught] == [0, 0, 1, 0, 0]  # once, when the streak reaches 3
    message = caught[2][0]
    assert "every reward has been 0 for 3 steps" in message
    assert "answer column" in message and "<answer>" in message
    assert run.extra["no_signal_steps"] == 5  # in run.extra: checkpointed with the run


def test_a_step_with_a_signal_restarts_the_no_signal_count(make_run):
    run = make_run((0, 1), no_signal_warning_steps=2)
    varied, _ = grpo.generate_rollouts(run)
    flat = varied.select(range(2, 4))  # group 1 alone: rewards 0, 0
    assert advantages_warnings(run, flat, steps=1) == [[]]
    assert advantages_warnings(run, varied, steps=1) == [[]]  # rewards 1, 0: count back to 0
    assert advantages_warnings(run, flat, steps=2)[1]  # a new streak of 2 warns


def test_no_signal_warning_steps_zero_never_warns(make_run):
    run = make_run((1, 1), no_signal_warning_steps=0)
    result, _ = grpo.generate_rollouts(run)
    assert advantages_warnings(run, result, steps=6) == [[]] * 6


def test_a_loss_reading_a_field_no_step_produces_is_refused_at_setup(make_run):
    run = make_run((0, 1))
    result, _ = grpo.generate_rollouts(run)
    batch = result.training_batch(run.tokenizer.pad_token_id)
    # The declared rollout fields are exactly what a rollout's training batch holds.
    assert batch.present() == grpo.steps.ROLLOUT_FIELDS

    class Misspelt:
        def batch_fields(self):
            return frozenset({"input_ids", "advantagez"})

    with pytest.raises(ValueError, match=r"names \['advantagez'\], which are not TrainBatch"):
        grpo.steps.check_batch_fields(Misspelt(), run.config)

    class ReadsATeacher:  # a real field, but no GRPO step fills it
        def batch_fields(self):
            return frozenset({"advantages", "teacher_logprobs"})

    with pytest.raises(
        ValueError, match=r"ReadsATeacher reads batch fields \['teacher_logprobs'\]"
    ):
        grpo.steps.check_batch_fields(ReadsATeacher(), run.config)
    grpo.steps.check_batch_fields(grpo.steps.make_loss(run.config), run.config)
    # With the KL penalty on, the default loss needs the reference log-probs, which the
    # step then produces.
    config = run.config.model_dump()
    config["loss_fn"]["reference_policy_kl_penalty"] = 0.1
    config["policy"]["reference_policy"] = {"enabled": True}
    kl_config = grpo.MasterConfig.model_validate(config)
    assert "reference_logprobs" in grpo.steps.make_loss(kl_config).batch_fields()
    grpo.steps.check_batch_fields(grpo.steps.make_loss(kl_config), kl_config)


def test_validation_logs_environment_metrics_of_all_its_batches_and_example_samples(make_run):
    import json

    run = make_run((0, 1, 2, 1))
    run.val_loader = run.train_loader  # two batches of two prompts
    run.config.logger.num_val_samples_to_print = 3
    # A training rollout first: its environment counts are its own, not validation's.
    grpo.generate_rollouts(run)
    run.step = 5
    metrics = grpo.validate(run)

    # Greedy replies: sample 0 solves at the first turn ("right"), 1 never, 2 does, 1 never.
    assert metrics["num_samples"] == 4.0
    assert metrics["reward_mean"] == pytest.approx(0.5)
    # One call to the environment after both batches: its metrics cover all four samples.
    assert metrics["env/puzzle/reward_mean"] == pytest.approx(0.5)
    assert metrics["env/puzzle/accuracy"] == pytest.approx(0.5)
    # and its counts only validation's four steps (one turn each), not the training rollout's.
    assert metrics["env/puzzle/samples"] == 4.0

    lines = [json.loads(x) for x in (run.logger.log_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [r["val/samples"] for r in lines if "val/samples" in r]
    assert [r["step"] for r in lines if "val/samples" in r] == [5, 5, 5]
    assert [s["reward"] for s in samples] == [1.0, 0.0, 1.0]
    assert samples[0]["completion"] == solved_reply()
    assert "[sample 1]" in samples[1]["prompt"] and samples[1]["prompt"].startswith("[user] ")


class LogprobPolicy:
    """Fixed, seeded log-probs for pi_old and the reference; records the calls in order and
    keeps the batch its train step got."""

    weight_version = 0

    def __init__(self):
        self.calls, self.trained = [], None

    def prepare_for_lp_inference(self):
        self.calls.append("prepare_for_lp_inference")

    def prepare_for_training(self):
        self.calls.append("prepare_for_training")

    def _logprobs(self, batch, seed):
        g = torch.Generator().manual_seed(seed)
        # What a policy gives at_loss_tokens: 0 off the loss's tokens, so that a step
        # reading pi_old or the reference there would read zeros and be caught.
        lp = -torch.rand(batch.input_ids.shape, generator=g)
        return torch.where(batch.loss_token_mask() > 0, lp, 0.0)

    def get_logprobs(self, batch, *, at_loss_tokens=False):
        assert at_loss_tokens
        self.calls.append("get_logprobs")
        return {"logprobs": self._logprobs(batch, 1)}

    def get_reference_policy_logprobs(self, batch, *, at_loss_tokens=False):
        assert at_loss_tokens
        self.calls.append("get_reference_policy_logprobs")
        return {"reference_logprobs": self._logprobs(batch, 2)}

    def train(self, batch, loss_fn):
        self.calls.append("train")
        self.trained = batch
        return TrainResult(1, {"loss": [0.0]})


def reference_kl_in_reward_returns(rewards, mask, group_size, pi_old, pi_ref, coef, eps=1e-8):
    """REINFORCE++ with the KL in the reward, from its formula in float64 loops: per action
    token t of sample i, G_it = (r_i - mean of i's group) - coef * sum_{s >= t} (log pi_old -
    log pi_ref)_s over i's action tokens, whitened over all action tokens (unbiased std)."""
    n, width = mask.shape
    returns = {}
    for i in range(n):
        group = rewards[(i // group_size) * group_size : (i // group_size + 1) * group_size]
        centred = float(rewards[i]) - sum(float(r) for r in group) / group_size
        for t in range(width):
            if mask[i, t]:
                to_go = sum(
                    float(pi_old[i, s]) - float(pi_ref[i, s]) for s in range(t, width) if mask[i, s]
                )
                returns[i, t] = centred - coef * to_go
    values = torch.tensor(list(returns.values()), dtype=torch.float64)
    mean, std = values.mean(), values.std()
    out = torch.zeros(n, width, dtype=torch.float64)
    for (i, t), g in returns.items():
        out[i, t] = (g - mean) / (std + eps)
    return out


def test_kl_in_reward_folds_the_kl_into_reinforce_plus_plus_returns_through_the_config(make_run):
    run = make_run((0, 1, 2, 1), advantage_estimator="reinforce_plus_plus")
    config = run.config.model_dump()
    config["loss_fn"].update(
        reference_policy_kl_penalty=0.3,
        use_kl_in_reward=True,
        reference_policy_kl_type="k1",  # log pi_old - log pi_ref, the paper's per-token KL
        kl_input_clamp_value=None,
        kl_output_clamp_value=None,
    )
    config["policy"]["reference_policy"] = {"enabled": True}
    run.config = grpo.MasterConfig.model_validate(config)
    run.loss_fn = grpo.steps.make_loss(run.config)
    run.policy = LogprobPolicy()
    result, _ = grpo.generate_rollouts(run)
    metrics = grpo.steps.train_on_rollouts(run, result)

    # pi_old and the reference first (the returns need them), then the train step.
    assert run.policy.calls == [
        "prepare_for_lp_inference",
        "get_logprobs",
        "get_reference_policy_logprobs",
        "prepare_for_training",
        "train",
    ]
    batch = run.policy.trained
    mask = batch.loss_mask > 0
    expected = reference_kl_in_reward_returns(
        result.rewards.double(),
        mask,
        2,
        batch.prev_logprobs.double(),
        batch.reference_logprobs.double(),
        0.3,
    )
    assert float(expected[mask].abs().sum()) > 0
    torch.testing.assert_close(batch.advantages.double(), expected, rtol=1e-5, atol=1e-6)
    # The KL it folded in is logged (the loss's kl_penalty is 0 under this setting).
    kl = (batch.prev_logprobs.double() - batch.reference_logprobs.double())[mask]
    assert metrics["kl_in_reward_mean"] == pytest.approx(float(kl.mean()), rel=1e-6)
    # Without the KL the advantages differ: the penalty is really in them.
    run.config.loss_fn.use_kl_in_reward = False
    plain, _ = grpo.compute_advantages(run, result, batch.loss_mask)
    assert not torch.allclose(plain["advantages"], batch.advantages)
    # The loss's own KL term is off: the KL counts once, in the returns.
    assert run.loss_fn.config.reference_policy_kl_penalty == 0.0
    assert "reference_logprobs" not in run.loss_fn.batch_fields()


@pytest.mark.parametrize(
    ("val_period", "val_at_end", "validated_after"),
    [(2, None, [2, 3]), (2, False, [2]), (0, True, [3]), (0, None, [])],
)
def test_validation_after_the_last_step_follows_val_at_end(
    make_run, val_period, val_at_end, validated_after
):
    from rl_algorithms.run import end_step

    run = make_run((0, 1, 2, 1))
    run.val_period, run.val_at_end, run.total_steps = val_period, val_at_end, 3
    validated: list[int] = []
    for run.step in (1, 2, 3):
        end_step(run, {"loss": 0.0}, validate=lambda: validated.append(run.step) or {})
    assert validated == validated_after


def test_each_validation_logs_samples_of_the_latest_training_step(make_run):
    import json

    from rl_algorithms.run import end_step

    run = make_run((0, 1, 2, 1))
    run.config.logger.num_val_samples_to_print = 3
    run.loss_fn = grpo.steps.make_loss(run.config)
    run.policy = LogprobPolicy()
    result, _ = grpo.generate_rollouts(run)
    metrics = grpo.steps.train_on_rollouts(run, result)
    run.val_period, run.total_steps = 2, 4
    for run.step in (1, 2):  # validation after step 2 only
        end_step(run, metrics, validate=lambda: {"accuracy": 0.5})

    lines = [json.loads(x) for x in (run.logger.log_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["train/samples"]) for r in lines if "train/samples" in r]
    assert logged == [(2, s) for s in result.samples(3)]
    assert [s["reward"] for _, s in logged] == result.rewards[:3].tolist()


def test_the_policy_gives_its_workers_at_loss_tokens_and_they_leave_the_prompt_out():
    # The Policy a run holds, its one DTensor worker in this process (no Ray).
    from rl_data.batch import TrainBatch
    from rl_models.policy.config import PolicyConfig

    from .conftest import TINY_LLAMA
    from .in_process import in_process_policy

    config = PolicyConfig.model_validate(
        {
            "model": {"hf_config": TINY_LLAMA, "dtype": "float64"},
            "train_global_batch_size": 4,
            "train_micro_batch_size": 4,
        }
    )
    policy = in_process_policy(config, "policy", [])
    g = torch.Generator().manual_seed(0)
    # Two rows share a prompt; one is switched off (sample_mask 0); one ends in its prompt.
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (4, 12), generator=g)
    ids[1, :6] = ids[0, :6]
    batch = TrainBatch(
        input_ids=ids,
        input_lengths=torch.tensor([12, 9, 12, 5]),
        loss_mask=(torch.arange(12) >= 6).double().expand(4, 12).clone(),
        sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]),
    )
    everywhere = policy.get_logprobs(batch)["logprobs"]
    at_loss = policy.get_logprobs(batch, at_loss_tokens=True)["logprobs"]
    wanted = batch.loss_token_mask() > 0
    assert wanted.any(1).tolist() == [True, True, False, False]
    torch.testing.assert_close(at_loss, torch.where(wanted, everywhere, 0.0), rtol=0, atol=1e-10)
    assert bool((everywhere[:, 1:5] != 0).all())  # the prompts' log-probs, left out above
