"""Adapter refit: a LoRA policy sends an HF generator its adapters alone, and the generator then
computes what the merged model computes (float64, against a merge done here by hand)."""

import os
import types

import pytest
import torch
from torch.func import functional_call

from rl_models.generation.config import GenerationConfig, lora_refit
from rl_models.generation.hf_worker import HfGenerationWorker
from rl_models.generation.refit import WeightSync, needs_refit, weight_sync
from rl_models.generation.vllm.adapters import RefitAdapters
from rl_models.losses import NLLLoss
from rl_models.modeling.lora import LoraConfig, write_adapter_dir
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.weight_transfer.buckets import unpack_bucket

from .conftest import initial_model, skewed_batch, tiny_config

LORA = {"enabled": True, "rank": 4, "alpha": 8.0}
ADAM = {"name": "AdamW", "kwargs": {"lr": 1e-2}}
PEFT_PREFIX = "base_model.model."


def send(policy: DTensorPolicyWorker, generator: HfGenerationWorker, lora_export: str) -> int:
    """One refit through object-store buckets, in process (``WeightSync.refit``'s calls, one
    rank each side); returns the bytes sent."""
    plan = policy.weight_export_plan(bucket_bytes=1 << 16, lora_export=lora_export)
    generator.prepare_for_weight_update()
    for step in range(plan.steps):
        generator.load_weight_bucket(policy.export_weight_bucket(step))
    policy.finish_weight_export()
    generator.set_weight_version(generator.get_weight_version() + 1)
    return plan.nbytes


def merged_by_hand(policy: DTensorPolicyWorker) -> dict[str, torch.Tensor]:
    """The plain HF state dict ``W + (alpha / rank) * B @ A``, computed here from the policy's
    peft state dict (not with ``lora.merged_state_dict``)."""
    state = {k.removeprefix(PEFT_PREFIX): v.detach() for k, v in policy.model.state_dict().items()}
    scale = LORA["alpha"] / LORA["rank"]
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if ".base_layer." in key:
            module = key.removesuffix(".base_layer.weight")
            a, b = (
                state[f"{module}.lora_A.default.weight"],
                state[f"{module}.lora_B.default.weight"],
            )
            value = value + b @ a * scale
        out[key.replace(".base_layer.", ".")] = value
    return out


def logits(model: torch.nn.Module, ids: torch.Tensor, weights=None) -> torch.Tensor:
    with torch.no_grad():
        if weights is None:
            return model(input_ids=ids).logits
        return functional_call(model, weights, (ids,)).logits


@pytest.fixture(scope="module")
def pair():
    """A float64 LoRA policy with random B (so the adapters do something) and an HF generator
    built from the same model config."""
    config = tiny_config(lora=LORA, optimizer=ADAM)
    policy = DTensorPolicyWorker(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    generator = HfGenerationWorker(
        {"backend": "hf", "sampling": {"max_new_tokens": 4}}, config.model.model_dump()
    )
    return policy, generator


def test_adapter_refits_give_the_merged_models_logits_and_send_only_the_adapters(pair):
    policy, generator = pair
    ids = skewed_batch()["input_ids"][:, :20]
    plain = initial_model()
    adapters = {k: v for k, v in policy.model.state_dict().items() if ".lora_" in k}
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
    merged_plan = policy.weight_export_plan(bucket_bytes=1 << 16)  # what "merged" would send
    policy.finish_weight_export()

    # First refit: the generator adds LoRA layers and gets the base layers with the adapters.
    generator.enable_lora_adapters(LoraConfig.model_validate(LORA).model_dump())
    assert send(policy, generator, "with_base") > merged_plan.nbytes
    want = logits(plain, ids, merged_by_hand(policy))
    torch.testing.assert_close(logits(generator.model, ids), want, rtol=0, atol=1e-10)

    # A training step, then an adapter-only refit: the bytes are the adapters', far below the
    # merged model's, and the generator follows the new weights.
    policy.train(skewed_batch(), NLLLoss())
    sent = send(policy, generator, "adapters")
    assert sent == adapter_bytes and sent < merged_plan.nbytes / 10
    new = logits(plain, ids, merged_by_hand(policy))
    assert float((new - want).abs().max()) > 1e-4  # the step changed the model
    torch.testing.assert_close(logits(generator.model, ids), new, rtol=0, atol=1e-10)
    # Its base weights are those the policy holds frozen: the adapters did all of the change.
    base = {k.removeprefix(PEFT_PREFIX): v for k, v in policy.model.state_dict().items()}
    for name, param in generator.model.named_parameters():
        assert torch.equal(param, base[name]), name


def test_the_generator_refuses_adapters_of_another_lora_config(pair):
    _, generator = pair
    generator.enable_lora_adapters(LoraConfig.model_validate(LORA).model_dump())  # the same: ok
    with pytest.raises(ValueError, match="already serves adapters"):
        generator.enable_lora_adapters({**LORA, "rank": 8})


def test_refit_adapters_kept_by_a_vllm_worker_load_in_peft_as_the_merged_model(pair, tmp_path):
    """What a vLLM worker does with a first adapter refit (``vllm.adapters.RefitAdapters``, no
    vLLM needed): the base layers come back under the plain HF names vLLM loads, and the
    adapters, written to a peft directory, load in peft as the merged model (float64)."""
    policy, _ = pair
    adapters = RefitAdapters(LoraConfig.model_validate(LORA))
    plan = policy.weight_export_plan(bucket_bytes=1 << 16, lora_export="with_base")
    base = {}
    for step in range(plan.steps):
        bucket = adapters.keep_bucket(policy.export_weight_bucket(step))
        base.update({name: tensor.clone() for name, tensor in unpack_bucket(bucket)})
    policy.finish_weight_export()
    plain = initial_model()
    assert base.keys() == plain.state_dict().keys()
    for name, tensor in plain.state_dict().items():  # the frozen base: the initial weights
        assert torch.equal(base[name], tensor), name

    directory = adapters.write()
    assert adapters.write() is None  # nothing kept since
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(initial_model(), directory).eval()
    assert sorted(loaded.peft_config["default"].target_modules) == sorted(
        LoraConfig().target_modules
    )
    ids = skewed_batch()["input_ids"][:, :20]
    want = logits(plain, ids, merged_by_hand(policy))
    assert float((want - logits(plain, ids)).abs().max()) > 1e-3  # the adapters matter
    torch.testing.assert_close(logits(loaded, ids), want, rtol=0, atol=1e-10)
    adapters.close()
    assert not os.path.exists(directory)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is not an adapter tensor"):
        write_adapter_dir(str(tmp_path), {"model.norm.weight": torch.ones(2)}, LoraConfig())


#: A generation backend that cannot load adapters (no built-in one is such).
NO_ADAPTERS = types.SimpleNamespace(backend="plain", loads_lora_adapters=False)


def test_lora_refit_sends_adapters_where_the_generator_loads_them():
    hf = GenerationConfig.model_validate({"backend": "hf"})
    vllm = GenerationConfig.model_validate({"backend": "vllm"})
    lora = LoraConfig.model_validate(LORA)
    assert lora_refit(LoraConfig(), hf) is None  # no LoRA
    assert lora_refit(lora, hf) == "adapters" and lora_refit(lora, vllm) == "adapters"
    merged = lora.model_copy(update={"refit": "merged"})
    assert lora_refit(merged, hf) == "merged" and lora_refit(merged, vllm) == "merged"
    # Merged weights only when asked for: auto, like adapters, refuses a generator without
    # adapters and says what to set, rather than sending the whole model every refit.
    assert lora_refit(merged, NO_ADAPTERS) == "merged"
    for refit in ("auto", "adapters"):
        with pytest.raises(
            ValueError,
            match=rf"policy\.lora\.refit: {refit} sends LoRA adapters, and generation\.backend: "
            r"plain cannot load them: set policy\.lora\.refit: merged",
        ):
            lora_refit(lora.model_copy(update={"refit": refit}), NO_ADAPTERS)


def test_a_vllm_generator_is_planned_to_serve_the_policys_adapters():
    vllm = GenerationConfig.model_validate({"backend": "vllm"})
    lora = LoraConfig.model_validate(LORA)
    assert vllm.serving_lora(lora).vllm.max_lora_rank == LORA["rank"]
    assert vllm.vllm.max_lora_rank is None  # a copy: the config itself is unchanged
    merged = lora.model_copy(update={"refit": "merged"})
    assert vllm.serving_lora(merged) is vllm and vllm.serving_lora(LoraConfig()) is vllm
    hf = GenerationConfig.model_validate({"backend": "hf"})
    assert hf.serving_lora(lora) is hf  # the HF generator adds its LoRA layers at the refit
    low = GenerationConfig.model_validate({"backend": "vllm", "vllm": {"max_lora_rank": 2}})
    with pytest.raises(ValueError, match=r"generation\.vllm\.max_lora_rank: 2 is below policy"):
        low.serving_lora(lora)


def test_a_policy_without_lora_refuses_an_adapter_export():
    policy = DTensorPolicyWorker(tiny_config())
    with pytest.raises(ValueError, match=r"needs a policy with lora\.enabled"):
        policy.weight_export_plan(bucket_bytes=1 << 16, lora_export="adapters")


class Controller:
    """A policy or generation controller as ``WeightSync`` reads them when it is made (the
    configs; no workers are called)."""

    def __init__(self, **attributes) -> None:
        self.__dict__.update(attributes)


def test_a_weight_sync_sends_what_the_policys_lora_refit_picks():
    policy = Controller(config=tiny_config(lora=LORA), worker_group=Controller())
    for backend in ("hf", "vllm"):
        generator = Controller(config=GenerationConfig.model_validate({"backend": backend}))
        assert WeightSync(policy, generator).lora == "adapters"
    merged = Controller(
        config=tiny_config(lora={**LORA, "refit": "merged"}), worker_group=Controller()
    )
    assert WeightSync(merged, Controller(config=NO_ADAPTERS)).lora == "merged"
    with pytest.raises(ValueError, match=r"set policy\.lora\.refit: merged"):
        _ = WeightSync(policy, Controller(config=NO_ADAPTERS)).lora


def test_a_generator_without_the_policys_adapters_is_refit_before_it_samples():
    vllm = GenerationConfig.model_validate({"backend": "vllm"})

    def pair(lora: dict | None) -> tuple[Controller, Controller]:
        config = tiny_config(lora=lora) if lora else tiny_config()
        policy = Controller(config=config, worker_group=Controller(), weight_version=0)
        return policy, Controller(config=vllm, weight_version=0, weight_sync=None)

    policy, generator = pair(LORA)
    assert needs_refit(policy, generator)  # version 0 on both, but no adapters yet
    sync = weight_sync(policy, generator)
    assert needs_refit(policy, generator)  # a sync made, still no refit through it
    sync.adapters_added = True  # as the first adapter refit leaves it
    assert not needs_refit(policy, generator)
    policy.weight_version = 1
    assert needs_refit(policy, generator)
    # A new policy's adapters are not the ones the generator holds.
    other, _ = pair(LORA)
    other.weight_version = 1
    assert needs_refit(other, generator)
    # Without LoRA, or with merged weights sent, equal versions need nothing.
    for lora in (None, {**LORA, "refit": "merged"}):
        policy, generator = pair(lora)
        assert not needs_refit(policy, generator)
        weight_sync(policy, generator)
        assert not needs_refit(policy, generator)
        policy.weight_version = 1
        assert needs_refit(policy, generator)
