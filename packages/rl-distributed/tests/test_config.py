"""Tests for rl_distributed.config: YAML inheritance, overrides, interpolation, validation."""

from __future__ import annotations

import enum
import textwrap
from pathlib import Path
from typing import Annotated, Literal

import pytest
from omegaconf import DictConfig, OmegaConf
from pydantic import Field

from rl_distributed.config import (
    ConfigError,
    ConfigModel,
    apply_overrides,
    load_config,
    parse_cli,
    register_resolvers,
    resolve_config,
    save_config,
    to_yaml,
    validate_config,
)


def write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


# ------------------------------------------------------------------------------------- defaults


def test_defaults_multi_level_multi_parent_merge_order(tmp_path: Path) -> None:
    write(
        tmp_path,
        "grand.yaml",
        """
        a: {x: grand, y: grand, z: grand, w: grand}
        only_grand: 1
        items: [1, 2, 3]
        """,
    )
    write(
        tmp_path,
        "p1.yaml",
        """
        defaults: grand
        a: {x: p1, y: p1, v: p1}
        """,
    )
    write(
        tmp_path,
        "p2.yaml",
        """
        a: {x: p2, v: p2}
        items: [9]
        """,
    )
    child = write(
        tmp_path,
        "child.yaml",
        """
        defaults: [p1, p2.yaml]
        a: {w: child, v: child}
        """,
    )
    cfg = load_config(child)
    assert "defaults" not in cfg
    assert plain(cfg) == {
        "a": {
            "x": "p2",  # the later parent beats the earlier one (and its own parent)
            "y": "p1",  # a parent beats its own parent
            "z": "grand",  # two levels up still reaches the child
            "w": "child",  # the child beats every parent
            "v": "child",
        },
        "only_grand": 1,
        "items": [9],  # lists are replaced, not concatenated
    }


def test_defaults_are_relative_to_the_file_that_names_them(tmp_path: Path) -> None:
    write(tmp_path, "base.yaml", "origin: top_level_base\n")  # must NOT be picked up
    write(tmp_path, "configs/common/base.yaml", "origin: common_base\nlr: 0.1\n")
    write(tmp_path, "configs/common/mid.yaml", "defaults: base\nmid: true\n")
    absolute = write(tmp_path, "elsewhere/abs.yaml", "from_abs: 1\n")
    run = write(
        tmp_path,
        "configs/exp/run.yaml",
        f"""
        defaults: [../common/mid.yaml, {absolute}]
        name: run
        """,
    )
    cfg = load_config(run)
    assert plain(cfg) == {
        "origin": "common_base",
        "lr": 0.1,
        "mid": True,
        "from_abs": 1,
        "name": "run",
    }


def test_defaults_cycle_is_reported_with_the_chain(tmp_path: Path) -> None:
    tmp_path = tmp_path.resolve()
    a = write(tmp_path, "a.yaml", "defaults: b.yaml\nx: 1\n")
    b = write(tmp_path, "b.yaml", "defaults: [c.yaml]\n")
    c = write(tmp_path, "c.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="Cycle") as exc:
        load_config(a)
    assert f"{a} -> {b} -> {c} -> {a}" in str(exc.value)

    selfish = write(tmp_path, "self.yaml", "defaults: self.yaml\n")
    with pytest.raises(ConfigError, match="Cycle"):
        load_config(selfish)


def test_diamond_inheritance_is_not_a_cycle(tmp_path: Path) -> None:
    write(tmp_path, "root.yaml", "shared: root\n")
    write(tmp_path, "left.yaml", "defaults: root.yaml\nleft: 1\n")
    write(tmp_path, "right.yaml", "defaults: root.yaml\nright: 2\nshared: right\n")
    top = write(tmp_path, "top.yaml", "defaults: [left.yaml, right.yaml]\n")
    assert plain(load_config(top)) == {"shared": "right", "left": 1, "right": 2}


def test_missing_parent_names_missing_file_and_referrer(tmp_path: Path) -> None:
    tmp_path = tmp_path.resolve()
    child = write(tmp_path, "sub/child.yaml", "defaults: [../nope.yaml]\nx: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(child)
    msg = str(exc.value)
    assert str(tmp_path / "nope.yaml") in msg
    assert str(child) in msg


def test_missing_root_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    tmp_path = tmp_path.resolve()
    write(tmp_path, "ok.yaml", "a: 1\n")
    broken = write(tmp_path, "broken.yaml", "a: 1\nb: [1, 2\nc: 3\n")
    child = write(tmp_path, "child.yaml", "defaults: broken.yaml\n")
    for path in (broken, child):  # also when the broken file is a parent
        with pytest.raises(ConfigError) as exc:
            load_config(path)
        assert str(broken) in str(exc.value)
        assert "line " in str(exc.value)


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "dup.yaml", "lr: 1\nlr: 2\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml, line 2.*duplicate key"):
        load_config(path)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    tmp_path = tmp_path.resolve()
    path = write(tmp_path, "list.yaml", text)
    with pytest.raises(ConfigError, match="mapping") as exc:
        load_config(path)
    assert str(path) in str(exc.value)


def test_empty_file_is_an_empty_config(tmp_path: Path) -> None:
    assert plain(load_config(write(tmp_path, "empty.yaml", "# nothing\n"))) == {}


# ------------------------------------------------------------------------------------ overrides

BASE = """
trainer:
  epochs: 3
  seed: 42
  steps: ???
optimizer:
  name: adam
  lr: 0.001
  betas: [0.9, 0.99]
policy:
  lr: 0.5
"""


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write(tmp_path, "base.yaml", BASE)


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("trainer.epochs=5", "trainer.epochs", 5),
        ("trainer.steps=100", "trainer.steps", 100),  # a ??? key exists and can be set
        ("optimizer.lr=1e-5", "optimizer.lr", 1e-5),
        ("optimizer.name=sgd", "optimizer.name", "sgd"),
        ("optimizer.betas=[0.8,0.9]", "optimizer.betas", [0.8, 0.9]),
        ("optimizer.betas.1=0.5", "optimizer.betas", [0.9, 0.5]),
        ("+optimizer.extra={a:1,b:[2,3]}", "optimizer.extra", {"a": 1, "b": [2, 3]}),
        ("trainer.seed=null", "trainer.seed", None),
        ("optimizer.name='5'", "optimizer.name", "5"),
        ('optimizer.name="hello world"', "optimizer.name", "hello world"),
        ("+trainer.resume=true", "trainer.resume", True),
        ("+new.deep.key=x", "new", {"deep": {"key": "x"}}),
        ("++trainer.epochs=7", "trainer.epochs", 7),
        ("++brand_new=1.5", "brand_new", 1.5),
    ],
)
def test_override_values(base: Path, override: str, key: str, expected: object) -> None:
    value = OmegaConf.select(load_config(base, [override]), key)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    assert value == expected
    assert type(value) is type(expected)


def test_dict_override_merges_into_existing_mapping(base: Path) -> None:
    cfg = load_config(base, ["optimizer={lr:0.1}"])  # Hydra semantics: merge, not replace
    assert plain(cfg)["optimizer"] == {"name": "adam", "lr": 0.1, "betas": [0.9, 0.99]}


def test_override_delete(base: Path) -> None:
    cfg = load_config(base, ["~trainer.seed", "~optimizer"])
    assert "seed" not in cfg.trainer
    assert "optimizer" not in cfg
    cfg = load_config(base, ["~trainer.seed=42"])  # value matches
    assert "seed" not in cfg.trainer


def test_override_delete_with_wrong_value_is_an_error(base: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(base, ["~trainer.seed=7"])
    msg = str(exc.value)
    assert "'~trainer.seed=7'" in msg
    assert "42" in msg


def test_override_interpolation_is_kept_lazy(base: Path) -> None:
    cfg = load_config(
        base, ["policy.lr=${optimizer.lr}", "+policy.scaled='${mul:${optimizer.lr},2}'"]
    )
    assert OmegaConf.is_interpolation(cfg.policy, "lr")
    assert cfg.policy.lr == 0.001
    cfg.optimizer.lr = 0.25  # changes flow through: the link was kept, not a copied value
    assert cfg.policy.lr == 0.25
    assert cfg.policy.scaled == 0.5


def test_unquoted_nested_interpolation_gets_a_quoting_hint(base: Path) -> None:
    with pytest.raises(ConfigError, match="must be quoted") as exc:
        load_config(base, ["+policy.x=${mul:${a},2}"])
    assert "+policy.x='${mul:${a},2}'" in str(exc.value)


def test_overrides_apply_in_order(base: Path) -> None:
    cfg = load_config(base, ["trainer.epochs=5", "++trainer.epochs=6", "trainer.epochs=9"])
    assert cfg.trainer.epochs == 9


def test_setting_a_missing_key_suggests_close_keys_else_plus(base: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(base, ["trainer.epoch=5"])
    msg = str(exc.value)
    assert "'trainer.epoch=5'" in msg
    assert "did you mean 'trainer.epochs'" in msg
    # A near miss is a typo: '+' would add the typo, to be refused by the typed config next.
    assert "+trainer.epoch" not in msg
    with pytest.raises(ConfigError) as exc:
        load_config(base, ["trainer.warmup_fraction=0.1"])  # nothing near it: a new key
    assert "to add a new key use '+trainer.warmup_fraction=0.1'" in str(exc.value)


def test_adding_an_existing_key_suggests_force_add(base: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(base, ["+trainer.epochs=5"])
    msg = str(exc.value)
    assert "'+trainer.epochs=5'" in msg
    assert "already exists" in msg
    assert "'++trainer.epochs=5'" in msg


def test_deleting_a_missing_key_is_an_error(base: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(base, ["~trainer.sed"])
    msg = str(exc.value)
    assert "'~trainer.sed'" in msg
    assert "did you mean 'trainer.seed'" in msg


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("trainer.epochs", "Cannot parse"),  # no '='
        ("trainer.epochs=[1,", "Cannot parse"),
        ("trainer.epochs=1,2", "sweeps are not supported"),
        ("trainer@pkg.epochs=1", "@package"),
    ],
)
def test_bad_override_strings_are_named(base: Path, override: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as exc:
        load_config(base, [override])
    assert repr(override) in str(exc.value)


def test_apply_overrides_does_not_mutate_its_input() -> None:
    cfg = OmegaConf.create({"a": {"b": 1}})
    out = apply_overrides(cfg, ["a.b=2", "+a.c=3"])
    assert plain(out) == {"a": {"b": 2, "c": 3}}
    assert plain(cfg) == {"a": {"b": 1}}


# -------------------------------------------------------------------------------- interpolation


def test_interpolation_across_files(tmp_path: Path) -> None:
    write(
        tmp_path,
        "base.yaml",
        """
        data: {batch_size: 8}
        logger: {run_name: "${name}-bs${data.batch_size}"}
        """,
    )
    child = write(
        tmp_path,
        "child.yaml",
        """
        defaults: base.yaml
        name: grpo
        policy: {train_batch: "${data.batch_size}"}
        """,
    )
    cfg = load_config(child, ["data.batch_size=16"])
    assert cfg.policy.train_batch == 16  # child -> parent key, after the override
    assert cfg.logger.run_name == "grpo-bs16"  # parent -> child key


def test_custom_resolvers(tmp_path: Path) -> None:
    register_resolvers()  # already registered on import: calling again is harmless
    register_resolvers()
    path = write(
        tmp_path,
        "r.yaml",
        """
        mbs: 4
        gbs: 64
        gpus: 8
        doubled: ${mul:${mbs},2}
        product: ${mul:${mbs},2,0.5}
        per_gpu: ${div:${gbs},${gpus}}
        uneven: ${div:${gbs},5}
        biggest: ${max:${mbs},${gpus},3}
        smallest: ${min:${mbs},${gpus}}
        """,
    )
    cfg = load_config(path)
    assert cfg.doubled == 8
    assert cfg.product == 4.0
    assert cfg.per_gpu == 8 and type(cfg.per_gpu) is int  # exact int division stays an int
    assert cfg.uneven == pytest.approx(12.8)
    assert cfg.biggest == 8
    assert cfg.smallest == 4


def test_env_interpolation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "e.yaml", "dir: ${oc.env:RL_TEST_CKPT_DIR,/tmp/default}\n")
    monkeypatch.delenv("RL_TEST_CKPT_DIR", raising=False)
    assert load_config(path).dir == "/tmp/default"
    monkeypatch.setenv("RL_TEST_CKPT_DIR", "/data/ckpt")
    assert load_config(path).dir == "/data/ckpt"


def test_resolution_errors_name_key_and_interpolation() -> None:
    cfg = OmegaConf.create({"policy": {"lr": "${optimizer.lrr}"}, "optimizer": {"lr": 1}})
    with pytest.raises(ConfigError) as exc:
        resolve_config(cfg)
    assert "policy.lr" in str(exc.value)
    assert "${optimizer.lrr}" in str(exc.value)
    assert exc.value.errors[0].key == "policy.lr"

    cfg = OmegaConf.create({"a": {"n": "${mul:${b},2}"}, "b": "four"})
    with pytest.raises(ConfigError, match=r"a\.n.*takes numbers"):
        resolve_config(cfg)

    cfg = OmegaConf.create({"trainer": {"steps": "???"}})
    with pytest.raises(ConfigError, match=r"trainer\.steps.*never set"):
        resolve_config(cfg)


# ----------------------------------------------------------------------------------- validation


class Precision(enum.Enum):
    BF16 = "bf16"
    FP32 = "fp32"


class ParamGroup(ConfigModel):
    lr: float = Field(gt=0)
    weight_decay: float = 0.0


class OptimizerConfig(ConfigModel):
    name: Literal["adam", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0)
    param_groups: list[ParamGroup] = []


class ClipLoss(ConfigModel):
    kind: Literal["clip"] = "clip"
    eps: float = 0.2


class KLLoss(ConfigModel):
    kind: Literal["kl"] = "kl"
    beta: float = 0.1


class TrainConfig(ConfigModel):
    name: str
    epochs: int = 1
    precision: Precision = Precision.BF16
    model_name: str = "tiny"  # `model_` prefix must not trigger pydantic warnings
    seed: int | None = None
    batch: int | str = 8
    optimizer: OptimizerConfig = OptimizerConfig()
    loss: Annotated[ClipLoss | KLLoss, Field(discriminator="kind")] = ClipLoss()
    base_lr: float = 1e-3


TRAIN = """
name: run
epochs: 2
precision: fp32
optimizer:
  name: sgd
  lr: ${mul:${base_lr},10}
  param_groups:
    - {lr: 0.1}
    - {lr: 0.2, weight_decay: 0.01}
loss: {kind: kl, beta: 0.05}
"""


def test_validation_success_into_nested_models(tmp_path: Path) -> None:
    path = write(tmp_path, "train.yaml", "base_lr: 0.01\n" + TRAIN)
    cfg = load_config(path, ["~base_lr", "+base_lr=0.02"])
    typed = validate_config(cfg, TrainConfig)
    assert typed.precision is Precision.FP32
    assert typed.optimizer.name == "sgd"
    assert typed.optimizer.lr == pytest.approx(0.2)  # interpolation resolved first
    assert typed.optimizer.param_groups[1] == ParamGroup(lr=0.2, weight_decay=0.01)
    assert isinstance(typed.loss, KLLoss) and typed.loss.beta == 0.05
    assert typed.seed is None and typed.epochs == 2


def _errors(data: dict, model: type[ConfigModel] = TrainConfig) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        validate_config(OmegaConf.create(data), model)
    return exc.value


def test_bad_literal_names_key_value_and_allowed_values() -> None:
    err = _errors({"name": "x", "optimizer": {"name": "adamw"}})
    assert "optimizer.name: got 'adamw' — expected one of 'adam', 'sgd'" in str(err)
    [issue] = err.errors
    assert (issue.key, issue.value, issue.kind) == ("optimizer.name", "adamw", "literal_error")


def test_bad_enum_lists_its_values() -> None:
    err = _errors({"name": "x", "precision": "fp8"})
    assert "precision: got 'fp8' — expected one of 'bf16', 'fp32'" in str(err)


def test_wrong_type_names_the_type() -> None:
    err = _errors({"name": "x", "epochs": "many"})
    assert "epochs: got 'many' — expected int" in str(err)
    err = _errors({"name": "x", "seed": "abc"})
    assert "seed: got 'abc' — expected int | None" in str(err)


def test_union_of_plain_types_is_reported_once() -> None:
    err = _errors({"name": "x", "batch": [1, 2]})
    assert len(err.errors) == 1
    assert "batch: got [1, 2] — expected int | str" in str(err)


def test_unknown_key_suggests_close_field() -> None:
    err = _errors({"name": "x", "optimizer": {"lrr": 0.1}})
    assert "optimizer.lrr: got 0.1 — unknown key; did you mean 'lr'?" in str(err)
    err = _errors({"name": "x", "zzz": 1})  # nothing close: list what is allowed
    assert "zzz: got 1 — unknown key; allowed keys: name, epochs" in str(err)


def test_missing_required_key() -> None:
    err = _errors({"epochs": 3})
    assert "name: missing required key — expected str" in str(err)
    assert err.errors[0].kind == "missing"


def test_nested_list_index_path_and_constraint() -> None:
    err = _errors({"name": "x", "optimizer": {"param_groups": [{"lr": 1}, {"lr": "fast"}]}})
    assert "optimizer.param_groups.1.lr: got 'fast' — expected float" in str(err)
    err = _errors({"name": "x", "optimizer": {"param_groups": [{"lr": -1}]}})
    assert "optimizer.param_groups.0.lr: got -1 — expected float, greater than 0" in str(err)


def test_discriminated_union_path_drops_the_tag() -> None:
    err = _errors({"name": "x", "loss": {"kind": "kl", "beta": "big"}})
    assert "loss.beta: got 'big' — expected float" in str(err)


def test_all_problems_are_listed_one_per_line() -> None:
    err = _errors({"epochs": "x", "optimizer": {"name": "rmsprop", "lrr": 1}})
    lines = str(err).splitlines()
    assert "4 problems" in lines[0]
    assert [issue.key for issue in err.errors] == [
        "name",
        "epochs",
        "optimizer.name",
        "optimizer.lrr",
    ]
    assert lines[1:] == [f"  {issue}" for issue in err.errors]


def test_config_model_forbids_unknown_keys_and_validates_assignment() -> None:
    opt = OptimizerConfig()
    with pytest.raises(ValueError):
        opt.name = "nope"  # type: ignore[assignment]
    with pytest.raises(ValueError):
        OptimizerConfig(momentum=0.9)  # type: ignore[call-arg]


# ------------------------------------------------------------------------------ CLI and saving


def test_parse_cli() -> None:
    assert parse_cli(["--config", "a.yaml", "x=1", "+y=2", "~z"]) == (
        Path("a.yaml"),
        ["x=1", "+y=2", "~z"],
    )
    assert parse_cli(["x=1", "--config=b/c.yaml"]) == (Path("b/c.yaml"), ["x=1"])
    assert parse_cli(["x=1"]) == (None, ["x=1"])
    assert parse_cli([]) == (None, [])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--lr=1"], "Unknown option '--lr=1'"),
        (["--help"], "Usage"),
        (["--config"], "needs a path"),
        (["--config="], "needs a path"),
        (["--config", "a.yaml", "--config", "b.yaml"], "twice"),
    ],
)
def test_parse_cli_errors(argv: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_cli(argv)


def test_save_config_round_trip(tmp_path: Path) -> None:
    path = write(tmp_path, "train.yaml", "base_lr: 0.01\ntag: '1e-3'\n" + TRAIN)
    cfg = load_config(path, ["+note=null"])
    out = save_config(cfg, tmp_path / "run" / "ckpt" / "config.yaml")
    text = out.read_text()
    assert "${" not in text  # interpolations are resolved in the saved file
    reloaded = load_config(out)
    assert plain(reloaded) == plain(cfg)
    assert reloaded.tag == "1e-3"  # a string that looks like a float stays a string
    assert to_yaml(cfg) == text


def test_save_validated_model_round_trip(tmp_path: Path) -> None:
    model = TrainConfig(name="r", precision=Precision.FP32, optimizer=OptimizerConfig(lr=0.5))
    out = save_config(model, tmp_path / "config.yaml")
    assert "precision: fp32" in out.read_text()
    assert validate_config(load_config(out), TrainConfig) == model
