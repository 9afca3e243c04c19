import pytest
import ray

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


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test process (starting Ray takes seconds)."""
    init_ray(num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()
