"""Backends chosen by name: typed configs per backend, their registry, and what they register."""

import copy
import importlib.metadata
import pickle
import sys
import textwrap
from typing import Literal

import pytest
import torch
from pydantic import Field

from rl_distributed.venvs import registry as python_envs
from rl_models import backends
from rl_models.backends import GENERATION_BACKENDS, POLICY_BACKENDS, Backend
from rl_models.generation.config import (
    GenerationConfig,
    HfGenerationConfig,
    VllmConfig,
    VllmGenerationConfig,
)
from rl_models.policy.config import (
    DTensorPolicyConfig,
    MegatronPolicyConfig,
    PolicyConfig,
    worker_config,
)

MODEL = {"hf_config": {"model_type": "llama"}}


def test_a_generation_config_is_the_config_of_its_backend():
    assert type(GenerationConfig(backend="hf")) is HfGenerationConfig
    assert type(GenerationConfig()) is VllmGenerationConfig  # vllm unless told otherwise
    assert type(GenerationConfig.model_validate({"backend": "hf"})) is HfGenerationConfig
    vllm = GenerationConfig.model_validate({"vllm": {"max_model_len": 64}})
    assert isinstance(vllm, VllmGenerationConfig) and vllm.vllm.max_model_len == 64
    # dumped with its backend's keys, and read back as the same class
    dumped = GenerationConfig(backend="hf", static_kv_decode=False).model_dump()
    assert dumped["static_kv_decode"] is False and "vllm" not in dumped
    assert GenerationConfig.model_validate(dumped) == HfGenerationConfig(static_kv_decode=False)


def test_code_asks_the_config_what_its_backend_can_do():
    hf, vllm = HfGenerationConfig(), VllmGenerationConfig()
    assert not hf.loads_model_from_disk and vllm.loads_model_from_disk
    assert not hf.streams_samples and not vllm.streams_samples
    assert VllmGenerationConfig(vllm={"async_engine": True}).streams_samples
    dtensor = PolicyConfig(model=MODEL, train_global_batch_size=2)
    megatron = PolicyConfig(
        model=MODEL,
        train_global_batch_size=2,
        backend="megatron",
        megatron={"tensor_parallel_size": 2, "pipeline_parallel_size": 3},
    )
    assert type(dtensor) is DTensorPolicyConfig and type(megatron) is MegatronPolicyConfig
    assert (dtensor.model_parallel_layout, dtensor.model_parallel_size) == ((1, 1), 1)
    assert (megatron.model_parallel_layout, megatron.model_parallel_size) == ((3, 2), 6)
    assert dtensor.supports_topk_logprobs and not megatron.supports_topk_logprobs


def test_keys_of_another_backend_are_refused_naming_it_unless_they_hold_its_defaults():
    # a resolved config written before a switch of backend holds the other one's defaults
    hf = GenerationConfig.model_validate({"backend": "hf", "vllm": VllmConfig().model_dump()})
    assert type(hf) is HfGenerationConfig and "vllm" not in hf.model_dump()
    with pytest.raises(
        ValueError, match=r"generation\.vllm\.\* settings need generation\.backend: vllm"
    ):
        GenerationConfig.model_validate({"backend": "hf", "vllm": {"max_model_len": 64}})
    assert (
        "static_kv_decode"
        not in GenerationConfig(backend="vllm", static_kv_decode=True).model_dump()
    )
    policy = {"model": MODEL, "train_global_batch_size": 2}
    with pytest.raises(ValueError, match=r"megatron\.\* settings need backend: megatron"):
        PolicyConfig.model_validate({**policy, "megatron": {"sequence_parallel": True}})
    assert type(PolicyConfig.model_validate({**policy, "megatron": {}})) is DTensorPolicyConfig


def test_a_worker_refuses_the_config_of_another_backend():
    # The Megatron worker handed a dtensor config once failed deep in its constructor.
    policy = {"model": MODEL, "train_global_batch_size": 2}
    assert type(worker_config("megatron", {**policy, "backend": "megatron"})) is (
        MegatronPolicyConfig
    )
    with pytest.raises(ValueError, match=r"'megatron' policy worker was given a config for "):
        worker_config("megatron", policy)
    with pytest.raises(ValueError, match=r"set the section.s backend: dtensor"):
        worker_config("dtensor", PolicyConfig(backend="megatron", **policy))


def test_an_unknown_backend_is_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"backend\n.*Input should be 'hf', 'vllm'"):
        GenerationConfig.model_validate({"backend": "vlm"})
    with pytest.raises(ValueError, match=r"no generation backend 'vlm'; known: 'hf', 'vllm'"):
        GenerationConfig(backend="vlm")


class CountedGeneration(GenerationConfig):
    """A section that adds keys of its own to any backend's (as GRPO's ``generation`` does)."""

    num_workers: int = Field(1, ge=1)


def test_a_subclass_with_keys_of_its_own_is_both_it_and_its_backend(monkeypatch):
    config = CountedGeneration.model_validate({"backend": "hf", "num_workers": 2})
    assert isinstance(config, CountedGeneration) and isinstance(config, HfGenerationConfig)
    assert config.num_workers == 2 and config.static_kv_decode
    assert type(CountedGeneration.model_validate(config.model_dump())) is type(config)
    assert type(CountedGeneration(backend="vllm")).__bases__ == (
        CountedGeneration,
        VllmGenerationConfig,
    )
    # made at run time, yet pickled and copied (Ray ships configs to its actors)
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.deepcopy(config) == config
    variants = CountedGeneration.config_variants()
    assert [v.model_fields["backend"].default for v in variants] == ["hf", "vllm"]


def test_a_backend_registers_its_workers_python_environment():
    vllm_env = "vllm-cuda" if torch.version.cuda else "vllm"
    vllm = GENERATION_BACKENDS.get("vllm")
    assert vllm.env_name == vllm_env
    worker = "rl_models.generation.vllm.worker.VllmGenerationWorker"
    assert python_envs.env_for(worker).name == vllm_env
    megatron = POLICY_BACKENDS.get("megatron")
    assert megatron.implementation == "rl_models.megatron.worker:MegatronPolicyWorker"
    assert python_envs.env_for("rl_models.megatron.worker.MegatronPolicyWorker").name == "mcore"
    assert python_envs.get("mcore").extras == ("mcore",)
    assert GENERATION_BACKENDS.get("hf").env_name == "system"


def test_a_backend_config_must_name_its_backend():
    with pytest.raises(ValueError, match=r"HfGenerationConfig\.backend must be Literal\['other'\]"):
        GENERATION_BACKENDS.register(Backend("other", HfGenerationConfig, "x:Y"))
    assert "other" not in GENERATION_BACKENDS.names()


def test_backends_of_installed_packages_are_found_through_entry_points(tmp_path, monkeypatch):
    (tmp_path / "plugged_backend.py").write_text(
        textwrap.dedent(
            """
            from typing import Literal

            from rl_models.backends import GENERATION_BACKENDS, Backend
            from rl_models.generation.config import GenerationConfig


            class PluggedConfig(GenerationConfig):
                backend: Literal["plugged"] = "plugged"


            GENERATION_BACKENDS.register(Backend("plugged", PluggedConfig, "x:Y"))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    group = GENERATION_BACKENDS.entry_point_group
    found = [importlib.metadata.EntryPoint("plugged", "plugged_backend", group)]
    monkeypatch.setattr(
        backends, "entry_points", lambda group: found if group == found[0].group else []
    )
    monkeypatch.setattr(GENERATION_BACKENDS, "_plugins_loaded", False)
    try:
        config = GenerationConfig.model_validate({"backend": "plugged"})
        assert type(config).__name__ == "PluggedConfig"
        assert "plugged" in GENERATION_BACKENDS.names()
    finally:
        GENERATION_BACKENDS.unregister("plugged")
        sys.modules.pop("plugged_backend", None)


def test_a_backend_is_accepted_while_it_is_registered():
    class Literally(GenerationConfig):
        backend: Literal["literally"] = "literally"

    GENERATION_BACKENDS.register(Backend("literally", Literally, "x:Y"))
    try:
        assert type(GenerationConfig(backend="literally")) is Literally
    finally:
        GENERATION_BACKENDS.unregister("literally")
    with pytest.raises(ValueError, match="no generation backend 'literally'"):
        GenerationConfig(backend="literally")


def test_a_policy_backend_claims_only_the_capabilities_it_builds():
    class Plugged(PolicyConfig):
        backend: Literal["plugged"] = "plugged"

    POLICY_BACKENDS.register(Backend("plugged", Plugged, "x:Y"))
    try:
        plugged = PolicyConfig(model=MODEL, train_global_batch_size=2, backend="plugged")
    finally:
        POLICY_BACKENDS.unregister("plugged")
    assert type(plugged) is Plugged
    assert not plugged.supports_topk_logprobs and not plugged.supports_gathered_logprobs
    dtensor = PolicyConfig(model=MODEL, train_global_batch_size=2)
    assert dtensor.supports_topk_logprobs and dtensor.supports_gathered_logprobs


def test_a_backend_names_its_class_module_colon_class_and_its_workers_with_an_env():
    dtensor = POLICY_BACKENDS.get("dtensor")
    path = "rl_models.policy.dtensor_worker.DTensorPolicyWorker"
    assert dtensor.implementation_class_path == path
    with pytest.raises(ValueError, match=r"'x\.Y' is not an import path 'module:Class'"):
        Backend("dotted", HfGenerationConfig, "x.Y")
    with pytest.raises(ValueError, match=r"python_env 'mcore' needs workers"):
        Backend("mine", HfGenerationConfig, "x:Y", python_env="mcore")
    assert Backend("mine", HfGenerationConfig, "x:Y", "mcore", workers="x").env_name == "mcore"


def test_policy_help_names_loss_inputs_by_their_classes():
    from rl_distributed.config import field_description

    for config in (DTensorPolicyConfig, MegatronPolicyConfig):
        texts = [field_description(config, name) for name in config.model_fields]
        assert not [t for t in texts if "loss_input_type" in t]
    assert "input_type = Logits" in field_description(PolicyConfig, "logprob_chunk_size")
