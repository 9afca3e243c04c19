"""``auto`` precision: bfloat16 where the device computes it natively, float32 elsewhere.

Both answers of the CPU check are forced here, so every branch runs on any machine."""

import pytest
import torch

from rl_models.modeling.precision import (
    compute_dtype,
    generator_dtype,
    native_bfloat16,
    settle_mixed_precision,
)
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import TINY_LLAMA, skewed_batch, tiny_config


@pytest.fixture(params=[False, True], ids=["emulated-bf16", "native-bf16"])
def native(request, monkeypatch):
    """The CPU answers as one with (True) or without (False) AVX512-BF16."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: request.param)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return request.param


def test_the_cpu_check_asks_torch_for_avx512_bf16_or_amx(monkeypatch):
    for avx512_bf16, amx in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert native_bfloat16("cpu") is (avx512_bf16 or amx)
    assert not native_bfloat16("mps")


def test_auto_is_bfloat16_only_where_native_and_an_explicit_bfloat16_is_kept(native):
    assert compute_dtype(None, "cpu") is None
    assert compute_dtype("auto", "cpu") == (torch.bfloat16 if native else None)
    if native:
        assert compute_dtype("bfloat16", "cpu") == torch.bfloat16
    else:
        with pytest.warns(UserWarning, match="without native bfloat16.*'auto' picks float32"):
            assert compute_dtype("bfloat16", "cpu") == torch.bfloat16


def test_the_driver_settles_auto_once_for_the_run(native):
    # On CPUs the driver's CPU answers for the workers'; a GPU run is asked of the GPUs the
    # driver sees (this host has none, so the cluster's are taken to be native).
    cpu_answer = "bfloat16" if native else None
    assert settle_mixed_precision("auto", use_gpus=False) == cpu_answer
    assert generator_dtype("auto", use_gpus=False) == cpu_answer
    if not torch.cuda.is_available():
        assert settle_mixed_precision("auto", use_gpus=True) == "bfloat16"
        assert generator_dtype("auto", use_gpus=True) == "bfloat16"
    # A backend without mixed precision (Megatron) computes in its weights' dtype.
    assert settle_mixed_precision("auto", use_gpus=True, supported=False) is None
    # Concrete settings pass unchanged.
    assert settle_mixed_precision("bfloat16", use_gpus=False) == "bfloat16"
    assert generator_dtype("float16", use_gpus=False) == "float16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the worker would compute on the GPU")
def test_a_worker_on_auto_computes_as_its_device_allows(native):
    data = skewed_batch()
    model = {"hf_config": TINY_LLAMA, "dtype": "float32"}
    auto = DTensorPolicyWorker(tiny_config(model=model, mixed_precision="auto"))
    seen = []
    auto.model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda _m, _i, out: seen.append(out.dtype)
    )
    got = auto.get_logprobs(data)["logprobs"]
    assert seen == [torch.bfloat16 if native else torch.float32]
    # float32 compute is exact against the weights' own; bf16 differs from it.
    full = DTensorPolicyWorker(tiny_config(model=model)).get_logprobs(data)["logprobs"]
    difference = float((got - full).abs().max())
    assert (difference > 0) if native else (difference == 0)


def test_megatron_takes_auto_as_its_own_float_weights():
    config = tiny_config(backend="megatron", mixed_precision="auto")
    assert not config.supports_mixed_precision and tiny_config().supports_mixed_precision
    with pytest.raises(ValueError, match="does not support mixed_precision"):
        tiny_config(backend="megatron", mixed_precision="bfloat16")


def test_the_dtensor_worker_refuses_a_megatron_config():
    with pytest.raises(ValueError, match="'dtensor' policy worker was given a config for "):
        DTensorPolicyWorker(tiny_config(backend="megatron"))
