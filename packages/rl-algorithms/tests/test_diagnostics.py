"""The generator/trainer mismatch warning: once, above the threshold, with a count kept."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from rl_algorithms.diagnostics import warn_on_mismatch
from rl_algorithms.grpo.config import GRPOConfig


def fake_run(threshold: float | None = 1e-2) -> SimpleNamespace:
    loop = GRPOConfig(
        num_prompts_per_step=1,
        num_generations_per_prompt=2,
        max_num_steps=10,
        mismatch_kl_warn_threshold=threshold,
    )
    config = SimpleNamespace(rollout=loop, LOOP_SECTION="grpo")
    return SimpleNamespace(config=config, extra={}, step=0)


def steps(run: SimpleNamespace, kls: list[float | None]) -> tuple[list[dict], list[str]]:
    """Feed one metric dict per step (None: the step reported no generator log-probs)."""
    logged, messages = [], []
    for kl in kls:
        run.step += 1
        metrics = {"reward_mean": 0.5} if kl is None else {"gen_train_kl_k3": kl}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logged.append(warn_on_mismatch(run, metrics))
        messages += [str(w.message) for w in caught if w.category is RuntimeWarning]
    return logged, messages


def test_below_the_threshold_nothing_is_said_and_the_count_stays_zero():
    logged, messages = steps(fake_run(), [1e-3, 9.9e-3, 1e-2])  # equal is not above
    assert messages == []
    assert [m["mismatch_kl_warn_steps"] for m in logged] == [0.0, 0.0, 0.0]


def test_above_it_one_warning_names_the_step_value_threshold_and_what_to_check():
    run = fake_run()
    logged, messages = steps(run, [1e-3, 0.05, 2e-3, 0.2, None, 0.03])
    assert len(messages) == 1
    text = messages[0]
    assert text.startswith("step 2:")
    assert "gen_train_kl_k3 = 0.05 exceeds grpo.mismatch_kl_warn_threshold = 0.01" in text
    assert "generation.dtype" in text and "policy.mixed_precision" in text
    assert "stale or failed refit" in text
    assert [m.get("mismatch_kl_warn_steps") for m in logged] == [0.0, 1.0, 1.0, 2.0, None, 3.0]
    assert run.extra["mismatch_kl_warn_steps"] == 3  # in run.extra: checkpointed with the run


def test_a_resumed_run_keeps_counting_without_warning_again():
    run = fake_run()
    steps(run, [0.5])
    resumed = fake_run()
    resumed.extra = dict(run.extra)
    logged, messages = steps(resumed, [0.5])
    assert messages == [] and logged == [{"mismatch_kl_warn_steps": 2.0}]


def test_a_null_threshold_never_warns_nor_logs():
    logged, messages = steps(fake_run(None), [1.0, 5.0])
    assert messages == [] and logged == [{}, {}]


def test_the_threshold_must_be_positive():
    with pytest.raises(ValueError, match="mismatch_kl_warn_threshold"):
        fake_run(0.0)
    assert GRPOConfig.model_fields["mismatch_kl_warn_threshold"].default == 1e-2


def test_the_synchronous_loop_counts_and_warns_on_the_metrics_it_logs(monkeypatch):
    from rl_algorithms.grpo import loop

    logged = []
    monkeypatch.setattr(loop, "start_loop", lambda run, validate, at_start: None)
    monkeypatch.setattr(loop, "end_step", lambda run, metrics, validate: logged.append(metrics))
    run = fake_run()
    run.total_steps = 3
    run.logger = SimpleNamespace(progress=SimpleNamespace(stop=lambda: None))
    kls = iter([1e-3, 0.5, 0.5])
    with pytest.warns(RuntimeWarning, match="step 2: .*gen_train_kl_k3 = 0.5") as caught:
        loop.train_steps(run, lambda run: {"gen_train_kl_k3": next(kls)})
    assert len([w for w in caught if "gen_train_kl_k3" in str(w.message)]) == 1
    assert [m["mismatch_kl_warn_steps"] for m in logged] == [0.0, 1.0, 2.0]


def test_distillations_policy_gradient_metric_is_watched_too():
    from rl_algorithms.losses.distillation import PG_METRIC_PREFIX

    run = fake_run()
    with pytest.warns(RuntimeWarning, match="gen_train_kl_k3 = 0.05"):
        logged = warn_on_mismatch(run, {f"{PG_METRIC_PREFIX}gen_train_kl_k3": 0.05})
    assert logged == {"mismatch_kl_warn_steps": 1.0}
