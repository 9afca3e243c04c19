"""The routes a mixture-of-experts generator records reach the training batch: through two
generation workers (their outputs padded to one width), two turns of a real environment, and
the rollout's padded training batch; and the GRPO config turns recording on, or refuses."""

import pytest
import torch

from rl_algorithms import cli
from rl_algorithms.episodes import generation_input
from rl_algorithms.rollouts import run_rollouts
from rl_data.messages import tokenize_message_logs
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.config import ConfigError
from rl_envs.sliding_puzzle import SlidingPuzzleConfig, SlidingPuzzleEnvironment, first_prompt
from rl_models.generation.config import GenerationConfig
from rl_models.modeling.config import ModelConfig
from rl_models.modeling.moe_routes import RouteRecorder

from .in_process import InProcessGroup, in_process_generation
from .test_config_mistakes import GRPO_RECIPE
from .test_rollouts import NEAR_SOLVED

# A tiny Qwen3-MoE: two MoE layers around a dense one, the test tokenizer's vocabulary.
TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "experts_implementation": "eager",  # the grouped-matmul kernel has no float64
}


class TwoWorkers(InProcessGroup):
    """Two real generation workers in this process: ``HfGeneration`` splits each batch between
    them and pads their outputs to one width, as over Ray."""

    dp_size = 2

    def __init__(self, workers, log):
        super().__init__("generation", workers[0], log)
        self.workers = workers

    def call_all(self, method, **kwargs):
        return [getattr(w, method)(**kwargs) for w in self.workers]

    def run_all_workers_multiple_data(self, method, **per_worker):
        return [
            getattr(w, method)(**{k: v[i] for k, v in per_worker.items()})
            for i, w in enumerate(self.workers)
        ]


def test_routes_reach_the_training_batch_through_padding_and_two_turns(
    tokenizer, template, tmp_path
):
    tokenizer.save_pretrained(tmp_path)  # the workers read stop strings' tokenizer from disk
    config = GenerationConfig.model_validate(
        {
            "backend": "hf",
            "record_routed_experts": True,
            "sampling": {"max_new_tokens": 6},
            "tokenizer": str(tmp_path),
        }
    )
    model = ModelConfig(hf_config=TINY_QWEN3_MOE, dtype="float64")
    generation = in_process_generation(config, model, [])
    first = generation.worker_group.worker
    second = type(first)(config.model_dump(), model.model_dump())
    generation.worker_group = TwoWorkers([first, second], [])
    # Three samples of different prompt lengths: the two workers' outputs differ in width.
    logs = [
        [
            {
                "role": "user",
                "content": f"[sample {k}] {'Solve this ' * k}{first_prompt(NEAR_SOLVED)}",
            }
        ]
        for k in range(3)
    ]
    tokenize_message_logs(logs, tokenizer, template, add_generation_prompt=True)
    batch = BatchedDataDict(
        message_log=logs,
        extra_env_info=[dict(NEAR_SOLVED) for _ in logs],
        task_name=["puzzle"] * len(logs),
    )
    # The generator's own output: each worker's rows padded to the wider one's width with -1.
    out = generation.generate(generation_input(logs, [None] * 3, tokenizer.pad_token_id))
    ends = out["unpadded_sequence_lengths"].tolist()
    assert len(set(ends)) == 3 and out["routed_experts"].shape[1] == max(ends)
    for b, end in enumerate(ends):
        assert bool((out["routed_experts"][b, : end - 1] >= 0).all())
        assert bool((out["routed_experts"][b, end - 1 :] == -1).all())
    env = SlidingPuzzleEnvironment(SlidingPuzzleConfig(max_turns=8))
    result = run_rollouts(
        generation, batch, tokenizer, template, {"puzzle": env}, max_seq_len=512, max_turns=2
    )
    assert result.turns.tolist() == [2, 2, 2]  # random replies: invalid moves, a second turn

    train = result.training_batch(tokenizer.pad_token_id)
    routes = train.routed_experts
    assert routes.dtype == torch.int16 and routes.shape[:2] == train.input_ids.shape
    assert routes.shape[2:] == (2, 2)
    net = first.model
    for b, n in enumerate(train.input_lengths.tolist()):
        # What the generator's routers choose over the whole conversation in one forward.
        with RouteRecorder(net) as recorder, torch.no_grad():
            net(input_ids=train.input_ids[b : b + 1, :n])
            expected = recorder.take()
        # Every token the generator ran has its route: the prompt, turn one (its last token and
        # closing text from turn two's prefill), the environment's reply, turn two but its
        # last sampled token. After that (turn two's last token, its closing text, padding): -1.
        last = int((train.loss_mask[b] > 0).nonzero().max())
        assert torch.equal(routes[b, :last].long(), expected[:last]), f"row {b}"
        assert bool((routes[b, last:] == -1).all()), f"row {b}"


GRPO = ["--config", str(GRPO_RECIPE), "tokenizer.path=/tokenizer"]


def test_router_replay_turns_on_recording_in_the_generator():
    config = cli.build_config(cli.load_algorithm("grpo"), [*GRPO, "policy.router_replay=true"])
    assert config.generation.record_routed_experts
    plain = cli.build_config(cli.load_algorithm("grpo"), GRPO)
    assert not plain.generation.record_routed_experts


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["generation.backend=vllm", "~policy.model.hf_config", "+policy.model.path=/m"],
            r"router_replay: true needs the generator's routed experts.*backend: vllm.*"
            r"enable_return_routed_experts",
        ),
        (["policy.backend=megatron"], r"backend 'megatron' does not support router_replay"),
    ],
)
def test_router_replay_where_it_cannot_work_is_refused(overrides, message):
    argv = [*GRPO, "policy.router_replay=true", *overrides]
    with pytest.raises(ConfigError, match=message):
        cli.build_config(cli.load_algorithm("grpo"), argv)
