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


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test process (starting Ray takes seconds)."""
    init_ray(num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


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
