"""NeMo RL's ``loss_fn`` keys of the newer objectives (CISPO, truncated importance sampling's
types) translated onto ours, and the ones whose meaning differs here refused saying why."""

from __future__ import annotations

import pytest

from rl_algorithms.nemo_compat import translate_file

from .test_nemo_compat import recipe, validated

NEMO_GRPO = "grpo_math_1B"


def refused(*overrides: str) -> dict[str, str]:
    translation, _ = translate_file(recipe(NEMO_GRPO), list(overrides), "grpo")
    return {e.key: e.reason for e in translation.refused}


def test_cispo_translates_with_its_clip_range():
    overrides = ("loss_fn.use_cispo=true", "loss_fn.ratio_clip_min=1.0", "loss_fn.ratio_clip_max=4")
    assert refused(*overrides) == {}
    loss = validated(NEMO_GRPO, *overrides)["loss_fn"]
    assert loss["use_cispo"] is True
    assert (loss["ratio_clip_min"], loss["ratio_clip_max"]) == (1.0, 4.0)
    assert loss["token_level_loss"] is True


def test_the_entropy_bonus_key_is_taken_as_ours():
    # NeMo RL has no entropy bonus: a recipe that adds ours gets it, not a refusal.
    assert refused("++loss_fn.entropy_coef=0.01") == {}
    assert validated(NEMO_GRPO, "++loss_fn.entropy_coef=0.01")["loss_fn"]["entropy_coef"] == 0.01


@pytest.mark.parametrize(
    ("kind", "low", "high"),
    [("tis", None, 2.0), ("icepop", 0.5, 5.0), ("seq-mask-tis", 0.999, 1.002)],
)
def test_truncated_importance_sampling_types_translate(kind, low, high):
    overrides = (
        "loss_fn.use_importance_sampling_correction=true",
        f"loss_fn.truncated_importance_sampling_type={kind}",
        f"loss_fn.truncated_importance_sampling_ratio={high}",
        f"loss_fn.truncated_importance_sampling_ratio_min={'null' if low is None else low}",
    )
    assert refused(*overrides) == {}
    loss = validated(NEMO_GRPO, *overrides)["loss_fn"]
    assert loss["truncated_importance_sampling_type"] == kind
    assert loss["truncated_importance_sampling_ratio"] == high
    assert loss["truncated_importance_sampling_ratio_min"] == low
    assert loss["use_importance_sampling_correction"] is True


def test_a_tis_floor_translates():
    overrides = (
        "loss_fn.use_importance_sampling_correction=true",
        "loss_fn.truncated_importance_sampling_type=tis",
        "loss_fn.truncated_importance_sampling_ratio=2.0",
        "loss_fn.truncated_importance_sampling_ratio_min=0.5",
    )
    assert refused(*overrides) == {}
    assert (
        validated(NEMO_GRPO, *overrides)["loss_fn"]["truncated_importance_sampling_ratio_min"]
        == 0.5
    )


def test_kl_in_reward_is_refused_saying_how_it_differs():
    grpo = refused("loss_fn.use_kl_in_reward=true")
    assert set(grpo) == {"loss_fn.use_kl_in_reward"}
    assert "leaving no KL penalty" in grpo["loss_fn.use_kl_in_reward"]
    assert "reference_policy_kl_penalty: 0" in grpo["loss_fn.use_kl_in_reward"]
    rpp = refused("loss_fn.use_kl_in_reward=true", "grpo.adv_estimator.name=reinforce_plus_plus")
    assert "summed from t to the response's end" in rpp["loss_fn.use_kl_in_reward"]
    assert validated(NEMO_GRPO)["loss_fn"]["use_kl_in_reward"] is False


def test_a_gspo_importance_weight_is_refused_as_nemo_multiplies_the_token_weights():
    gspo = ("loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false")
    assert refused(*gspo) == {}
    why = refused(*gspo, "loss_fn.use_importance_sampling_correction=true")
    assert set(why) == {"loss_fn.use_importance_sampling_correction"}
    assert "exp(sum_t" in why["loss_fn.use_importance_sampling_correction"]


@pytest.mark.parametrize(
    "key", ["disable_ppo_ratio", "force_on_policy_ratio", "positive_example_nll_weight=0.1"]
)
def test_objectives_we_lack_stay_refused(key):
    key, _, value = key.partition("=")
    assert set(refused(f"loss_fn.{key}={value or 'true'}")) == {f"loss_fn.{key}"}


def test_gdpos_estimator_settings_win_over_the_top_level_ones_nemo_does_not_read():
    """NeMo's GDPO recipe sets ``grpo.adv_estimator.use_leave_one_out_baseline: false`` under a
    parent with ``grpo.use_leave_one_out_baseline: true``: NeMo's estimator reads the first."""
    gdpo = ("grpo.adv_estimator.name=gdpo", "grpo.adv_estimator.use_leave_one_out_baseline=false")
    translation, _ = translate_file(recipe(NEMO_GRPO), list(gdpo), "grpo")
    assert not translation.refused
    ignored = {e.key: e.reason for e in translation.ignored}
    assert (
        "reads grpo.adv_estimator.use_leave_one_out_baseline"
        in (ignored["grpo.use_leave_one_out_baseline"])
    )
    # (Validation would then refuse GDPO with this recipe's single-reward math environment.)
    grpo = translation.config["grpo"]
    assert grpo["advantage_estimator"] == "gdpo"
    assert grpo["use_leave_one_out_baseline"] is False
    assert grpo["normalize_rewards"] is True
    # Without a difference the top-level key translates as before.
    assert validated(NEMO_GRPO)["grpo"]["use_leave_one_out_baseline"] is True


@pytest.mark.parametrize(("weights", "refused_"), [(None, False), ([1, 1], False), ([1, 2], True)])
def test_gdpos_reward_weights_are_refused_unless_they_change_nothing(weights, refused_):
    from rl_algorithms.nemo_compat.translate import translate

    tree = {"grpo": {"adv_estimator": {"name": "gdpo", "reward_weights": weights}}}
    why = {e.key: e.reason for e in translate(tree, "grpo").refused}
    assert ("grpo.adv_estimator.reward_weights" in why) is refused_
    if refused_:
        assert "env.<task>.config.functions" in why["grpo.adv_estimator.reward_weights"]


@pytest.mark.parametrize("override", [True, False])
def test_a_nemo_child_recipe_replaces_its_parents_data_with_override(tmp_path, override):
    """NeMo's GDPO recipe replaces its parent's whole ``data`` section with ``_override_:
    true``, the marker our own recipes use: it is obeyed, and not a key to translate."""
    import shutil

    shutil.copy(recipe(NEMO_GRPO), tmp_path / f"{NEMO_GRPO}.yaml")
    (tmp_path / "child.yaml").write_text(
        f"defaults: {NEMO_GRPO}.yaml\n"
        "data:\n"
        f"  _override_: {str(override).lower()}\n"
        "  train:\n"
        "    dataset_name: OpenMathInstruct-2\n"
        "  default:\n"
        "    processor: math_hf_data_processor\n"
        "    env_name: math\n"
    )
    translation, _ = translate_file(tmp_path / "child.yaml", [], "grpo")
    assert not translation.refused
    keys = {e.key for e in translation.translated + translation.ignored}
    # The parent's validation split and prompt file are gone only when the child replaces.
    parents = {"data.train.split_validation_size", "data.default.prompt_file", "data.shuffle"}
    assert (keys & parents == set()) is override
    assert not any("_override_" in k for k in keys)
