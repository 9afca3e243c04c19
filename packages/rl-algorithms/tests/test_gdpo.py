"""GDPO (``grpo.advantage_estimator: gdpo``): each reward normalised within its group apart, the
weighted sum whitened over the batch. Checked against plain float64 loops written from the
paper's formulas, and from the environment's components to the advantages a step trains on."""

import math
import types

import pytest
import torch

from rl_algorithms import grpo
from rl_algorithms.advantages import gdpo_advantages, grpo_advantages
from rl_algorithms.grpo.steps import compute_advantages
from rl_algorithms.rollouts import RolloutResult, run_rollouts
from rl_envs.interfaces import RewardComponents
from rl_envs.sliding_puzzle import SlidingPuzzleConfig, SlidingPuzzleEnvironment

from .test_rollouts import SCRIPT, ScriptedGeneration, puzzle_batch

EPS = 1e-6


def reference_gdpo(components, weights, G, leave_one_out, normalize_std, sample_mask):
    """GDPO from the paper, one number at a time: per reward k and group, A_ik = (r_ik -
    baseline) / (std of the group's r_k + eps) (baseline: the group's mean, or the mean of the
    other G-1 samples; a group whose r_k are all equal gets 0); A_i = sum_k w_k A_ik, then
    (A_i - mean) / (std + eps) with the mean and unbiased std of the samples in the loss."""
    n, k_count = len(components), len(weights)
    per_reward = [[0.0] * k_count for _ in range(n)]
    for k in range(k_count):
        for start in range(0, n, G):
            group = [float(components[i][k]) for i in range(start, start + G)]
            mean = sum(group) / G
            std = math.sqrt(sum((v - mean) ** 2 for v in group) / (G - 1)) if G > 1 else 0.0
            for j, value in enumerate(group):
                baseline = (sum(group) - value) / (G - 1) if leave_one_out else mean
                adv = value - baseline
                if normalize_std and G > 1:
                    adv = adv / (std + EPS) if std > EPS else 0.0
                per_reward[start + j][k] = adv
    combined = [sum(w * a for w, a in zip(weights, row, strict=True)) for row in per_reward]
    kept = [i for i in range(n) if sample_mask[i] > 0]
    mean = sum(combined[i] for i in kept) / len(kept)
    var = sum((combined[i] - mean) ** 2 for i in kept) / (len(kept) - 1) if len(kept) > 1 else 0
    std = math.sqrt(var)
    out = [0.0] * n
    for i in kept:
        out[i] = (combined[i] - mean) / (std + EPS) if std > EPS else 0.0
    return (
        torch.tensor(out, dtype=torch.float64),
        torch.tensor(per_reward, dtype=torch.float64),
    )


def random_components(seed, prompts=5, G=4):
    """A correctness-like 0/1 reward, a continuous one and a format-like reward that is
    constant within the first two groups (zero std there)."""
    gen = torch.Generator().manual_seed(seed)
    n = prompts * G
    binary = torch.randint(0, 2, (n,), generator=gen).double()
    continuous = torch.rand(n, generator=gen, dtype=torch.float64) * 3 - 1
    fmt = torch.randint(0, 2, (n,), generator=gen).double()
    fmt[:G] = 1.0
    fmt[G : 2 * G] = 0.0
    return torch.stack([binary, continuous, fmt], dim=1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_gdpo_matches_the_float64_reference(seed, leave_one_out, normalize_std, masked):
    G, weights = 4, [1.0, 0.5, -0.25]
    components = random_components(seed, G=G)
    n = len(components)
    mask = torch.ones(n)
    if masked:  # dropped samples and a whole filler group out of the loss
        mask[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:3]] = 0
        mask[-G:] = 0
    got, per_reward = gdpo_advantages(
        components,
        weights,
        G,
        leave_one_out=leave_one_out,
        normalize_std=normalize_std,
        sample_mask=mask if masked else None,
    )
    expected, expected_per_reward = reference_gdpo(
        components.tolist(), weights, G, leave_one_out, normalize_std, mask.tolist()
    )
    torch.testing.assert_close(per_reward, expected_per_reward, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert float(expected.abs().sum()) > 0
    if normalize_std:  # the format reward is constant in groups 0 and 1: no advantage there
        assert per_reward[: 2 * G, 2].abs().max() == 0
    kept = got[mask > 0]
    assert float(kept.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(kept.std()) == pytest.approx(1.0, abs=1e-5)
    assert got[mask == 0].abs().max() == 0 if masked else True


def test_gdpo_keeps_apart_reward_combinations_grpo_collapses():
    """The paper's example: two 0/1 rewards, G=2. GRPO on the sum gives (1,1) vs (0,0) and
    (0,1) vs (0,0) the same advantages, +-0.707; GDPO tells them apart (both rewards differ
    in the first group, one in the second: twice the advantage)."""
    components = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    summed = grpo_advantages(components.sum(1), 2)
    torch.testing.assert_close(summed[:2], summed[2:], rtol=1e-5, atol=1e-5)
    gdpo, _ = gdpo_advantages(components, [1.0, 1.0], 2)
    torch.testing.assert_close(gdpo[:2], 2 * gdpo[2:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_one_reward_gdpo_is_grpo_scaled_to_unit_batch_std(seed, leave_one_out):
    """K = 1, weight w > 0, every sample in the loss: each component advantage is exactly
    GRPO's, whose batch mean is 0 (each group's is), so GDPO is GRPO's advantages divided by
    their batch std (+eps): the same direction, unit scale. With w < 0 the sign flips."""
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    grpo_adv = grpo_advantages(rewards, 4, leave_one_out=leave_one_out)
    for weight in (2.0, -1.0):
        got, per_reward = gdpo_advantages(rewards[:, None], [weight], 4, leave_one_out)
        torch.testing.assert_close(per_reward[:, 0], grpo_adv, rtol=0, atol=0)
        expected = weight * grpo_adv / (abs(weight) * grpo_adv.std() + EPS)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_gdpo_refuses_components_that_do_not_match_the_weights():
    with pytest.raises(ValueError, match=r"\[N, K\] with K = len\(weights\) = 2"):
        gdpo_advantages(torch.zeros(4, 3), [1.0, 1.0], 2)
    with pytest.raises(ValueError, match="num_generations_per_prompt"):
        gdpo_advantages(torch.zeros(5, 1), [1.0], 2)
    with pytest.raises(ValueError, match="sample_mask"):
        gdpo_advantages(torch.zeros(4, 1), [1.0], 2, sample_mask=torch.ones(3))


# --- the config ---------------------------------------------------------------------------------


def gdpo_config(env=None, **grpo_overrides):
    env = env or {
        "qa": {
            "kind": "reward_functions",
            "config": {
                "functions": [
                    {"function": "math", "name": "correct"},
                    {"function": "math", "name": "format", "weight": 0.5},
                ]
            },
        }
    }
    return grpo.MasterConfig.model_validate(
        {
            "policy": {
                "model": {"hf_config": {"model_type": "llama"}},
                "train_global_batch_size": 4,
                "max_total_sequence_length": 512,
            },
            "tokenizer": {"path": "unused"},
            "generation": {"backend": "hf"},
            "loss_fn": {"reference_policy_kl_penalty": 0.0},
            "env": env,
            "data": {"train": {"source": "arithmetic"}},
            "grpo": {
                "num_prompts_per_step": 2,
                "num_generations_per_prompt": 2,
                "max_num_steps": 1,
                "advantage_estimator": "gdpo",
                **grpo_overrides,
            },
        }
    )


def test_the_config_key_selects_gdpo():
    assert gdpo_config().grpo.advantage_estimator == "gdpo"


def test_gdpo_with_a_single_reward_environment_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"grpo.advantage_estimator: gdpo .* env.puzzle"):
        gdpo_config(env={"puzzle": {"kind": "sliding_puzzle"}})


def test_gdpo_with_tasks_whose_reward_functions_differ_is_refused_before_anything_runs():
    qa = gdpo_config().model_dump()["env"]["qa"]
    same = {"qa": qa, "qa2": qa}
    assert set(gdpo_config(env=same).env) == {"qa", "qa2"}  # the same components: accepted
    reweighted = {"functions": [{**f, "weight": 2.0} for f in qa["config"]["functions"]]}
    for other in (
        {"kind": "reward_functions", "config": reweighted},
        {"kind": "reward_functions", "config": {"functions": [{"function": "math"}]}},
    ):
        with pytest.raises(ValueError, match=r"gdpo with several environments .* env\.qa2: "):
            gdpo_config(env={"qa": qa, "qa2": other})


def test_gdpo_with_the_kl_in_the_reward_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"use_kl_in_reward: true needs grpo\.advantage_estimator"):
        grpo.MasterConfig.model_validate(
            {
                **gdpo_config().model_dump(),
                "loss_fn": {"reference_policy_kl_penalty": 0.1, "use_kl_in_reward": True},
                "policy": {
                    **gdpo_config().policy.model_dump(),
                    "reference_policy": {"enabled": True},
                },
            }
        )


# --- from the rollout to the advantages ---------------------------------------------------------

NAMES, WEIGHTS = ("correct", "format"), (1.0, 0.5)


def rollout(components, filler=None, lengths=None):
    """A rolled-out batch of single-turn samples whose response has ``lengths[i]`` tokens."""
    n = len(components)
    lengths = lengths or [3] * n
    values = torch.tensor(components, dtype=torch.float32)
    rc = RewardComponents(NAMES, WEIGHTS, values)
    logs = [
        [
            {"role": "user", "token_ids": torch.ones(2, dtype=torch.long)},
            {"role": "assistant", "token_loss_mask": torch.ones(length, dtype=torch.long)},
        ]
        for length in lengths
    ]
    return RolloutResult(
        message_logs=logs,
        rewards=rc.combined().float(),
        truncated=torch.zeros(n, dtype=torch.bool),
        terminated=torch.ones(n, dtype=torch.bool),
        turns=torch.ones(n, dtype=torch.long),
        env_metadata=[None] * n,
        answers=[None] * n,
        filler=filler,
        reward_components=rc,
    )


def fake_run(config):
    return types.SimpleNamespace(config=config, extra={})


COMPONENTS = [[1, 1], [0, 1], [1, 0], [1, 1], [0, 0], [1, 1], [0, 1], [1, 0]]


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_a_step_trains_on_gdpo_advantages_and_logs_each_rewards(leave_one_out, normalize):
    run = fake_run(
        gdpo_config(
            num_prompts_per_step=4,
            use_leave_one_out_baseline=leave_one_out,
            normalize_rewards=normalize,
        )
    )
    filler = torch.tensor([False] * 6 + [True] * 2)  # dynamic sampling's filler group
    result = rollout(COMPONENTS, filler=filler)
    loss_mask = torch.zeros(8, 6)
    loss_mask[:, 2:5] = 1
    fields, metrics = compute_advantages(run, result, loss_mask)
    mask = (~filler).double().tolist()
    expected, per_reward = reference_gdpo(COMPONENTS, WEIGHTS, 2, leave_one_out, normalize, mask)
    torch.testing.assert_close(
        fields["advantages"], (expected[:, None] * loss_mask).float(), rtol=1e-6, atol=1e-6
    )
    assert fields["sample_mask"].tolist() == mask
    for k, name in enumerate(NAMES):
        kept = per_reward[:6, k]
        assert metrics[f"gdpo/{name}/advantage_mean"] == pytest.approx(float(kept.mean()))
        assert metrics[f"gdpo/{name}/advantage_std"] == pytest.approx(float(kept.std()))
    # The combined reward is what GRPO would have seen: the reward metrics are unchanged.
    assert metrics["reward_mean"] == pytest.approx(float(result.rewards.mean()))


def test_reward_shapings_overlong_penalty_is_one_more_reward_to_normalise():
    shaping = {
        "enabled": True,
        "max_response_length": 4,
        "overlong_buffer_length": 2,
        "overlong_buffer_penalty": 2.0,
    }
    run = fake_run(gdpo_config(num_prompts_per_step=4, reward_shaping=shaping))
    lengths = [1, 4, 3, 2, 4, 1, 2, 3]
    result = rollout(COMPONENTS, lengths=lengths)
    fields, metrics = compute_advantages(run, result, torch.ones(8, 4))
    # penalty: 0 up to 2 tokens, -0.5 at 3, -1 at 4; weighted by overlong_buffer_penalty.
    penalty = [0.0, -1.0, -0.5, 0.0, -1.0, 0.0, 0.0, -0.5]
    rows = [[*c, p] for c, p in zip(COMPONENTS, penalty, strict=True)]
    expected, _ = reference_gdpo(rows, [*WEIGHTS, 2.0], 2, False, True, [1.0] * 8)
    torch.testing.assert_close(fields["advantages"][:, 0].double(), expected, rtol=1e-6, atol=1e-6)
    assert "gdpo/overlong_penalty/advantage_std" in metrics


def test_reward_scaling_maps_each_component_before_gdpo_normalises_it():
    # GDPO's normalisation undoes a plain linear map; the clamp to the source range is what
    # changes its advantages (the first reward's differences above 0.5 vanish).
    scaling = {"enabled": True, "source_min": 0.0, "source_max": 0.5, "target_max": 2.0}
    run = fake_run(gdpo_config(num_prompts_per_step=4, reward_scaling=scaling))
    rows = [[0.9, 0.2], [0.6, 0.0], [1.0, 0.4], [0.2, 0.1]]
    rows += [[0.7, 0.3], [0.3, 0.3], [0.8, 0.0], [0.1, 0.4]]
    fields, _ = compute_advantages(run, rollout(rows), torch.ones(8, 3))
    scaled = [[min(v, 0.5) * 4.0 for v in row] for row in rows]
    expected, _ = reference_gdpo(scaled, WEIGHTS, 2, False, True, [1.0] * 8)
    torch.testing.assert_close(fields["advantages"][:, 0].double(), expected, rtol=1e-6, atol=1e-6)
    unscaled, _ = reference_gdpo(rows, WEIGHTS, 2, False, True, [1.0] * 8)
    assert not torch.allclose(expected, unscaled, atol=1e-3)


def test_a_batch_without_components_is_a_clear_error_naming_the_key():
    run = fake_run(gdpo_config(num_prompts_per_step=4))
    result = rollout(COMPONENTS)
    result.reward_components = None
    with pytest.raises(ValueError, match=r"grpo\.advantage_estimator: gdpo needs every sample's"):
        compute_advantages(run, result, torch.ones(8, 3))


class ComponentPuzzle(SlidingPuzzleEnvironment):
    """The puzzle's reward as a "solved" component, and a "turns" component of 1 per turn
    weighted 0, so that the weighted sum stays the puzzle's reward."""

    def step(self, message_log_batch, metadata):
        ret = super().step(message_log_batch, metadata)
        values = torch.stack([ret.rewards, torch.ones(len(ret.rewards))], dim=1)
        return ret._replace(
            reward_components=RewardComponents(("solved", "turns"), (1.0, 0.0), values)
        )


def test_rollouts_carry_the_components_summed_over_turns_through_select_and_concat(
    tokenizer, template
):
    batch = puzzle_batch(tokenizer, template)
    env = ComponentPuzzle(SlidingPuzzleConfig(max_turns=8))
    result = run_rollouts(
        ScriptedGeneration(tokenizer, SCRIPT),
        batch,
        tokenizer,
        template,
        {"puzzle": env},
        max_seq_len=512,
        max_turns=2,
    )
    rc = result.reward_components
    assert rc.names == ("solved", "turns") and rc.weights == (1.0, 0.0)
    assert rc.values.tolist() == [[1.0, 1.0], [1.0, 2.0], [0.0, 2.0]]
    torch.testing.assert_close(rc.combined().float(), result.rewards)
    both = RolloutResult.concat([result.select([2, 0]), result.as_filler()])
    assert both.reward_components.values.tolist() == [[0, 2], [1, 1], [1, 1], [1, 2], [0, 2]]
    # A batch mixing an environment without components has none: GDPO then refuses it.
    batch["task_name"] = ["puzzle", "plain", "puzzle"]
    mixed = run_rollouts(
        ScriptedGeneration(tokenizer, SCRIPT),
        batch,
        tokenizer,
        template,
        {"puzzle": env, "plain": SlidingPuzzleEnvironment()},
        max_seq_len=512,
    )
    assert mixed.reward_components is None
