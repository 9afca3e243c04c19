"""A mixture of experts on the Megatron-core worker with tensor or pipeline parallelism, and
the routers' load-balancing loss (``megatron.moe_aux_loss_coeff``), against plain PyTorch.

Two CPU workers (gloo) hold one Qwen3-MoE replica between them: two tensor-parallel shards
with sequence parallelism (which Megatron requires beside experts), each routing half of every
sequence, or two pipeline stages, each holding one layer's router. Four workers make two such
tensor-parallel replicas that split each layer's experts (expert parallelism beside tensor
parallelism). One step of two
micro-batches with the load-balancing loss on must move the weights as a float64 reference
written from the formula does (the Switch Transformer loss of each layer, summed over layers,
weighted by the micro-batches' token counts), and the ``moe_aux_loss`` metric must equal the
reference's value: every layer's, whichever stage or tensor rank routed its tokens.
Tolerance as in ``test_megatron_worker.py``.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import rl_models.megatron  # noqa: F401  (registers rl_models.megatron -> the mcore env)
from rl_data.batch import TrainBatch
from rl_distributed import RayVirtualCluster
from rl_models.losses import NLLLoss
from rl_models.policy.lm_policy import Policy

from .conftest import save_tiny, skewed_batch, tiny_config
from .test_megatron_parallel import TINY_QWEN3_MOE
from .test_megatron_worker import ATOL, hf_logprobs

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

COEFF = 0.5
# Two micro-batches of four rows each, as wide as their longest row (20 and 17 tokens;
# sequence parallelism pads the second to 18), so they weigh differently and hold padding.
LENGTHS, MICRO = (13, 20, 7, 15, 11, 17, 16, 9), 4
#: Each layout's ``megatron`` section and ranks. With ep=2 beside tp=2 there are two
#: data-parallel replicas (four ranks), each given one of the two micro-batches.
LAYOUTS = {
    "tp2-sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, 2),
    "pp2": ({"pipeline_parallel_size": 2}, 2),
    "tp2-sp-ep2": (
        {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2},
        4,
    ),
}


def switch_loss(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """One layer's load-balancing loss over the tokens of ``router_logits [T, E]``:
    ``E / (k T^2) * sum_e count_e * sum_t p_te``, ``count_e`` the tokens routed to expert e
    (top k of the softmax, not differentiated) and ``p`` the softmax over all experts."""
    tokens, experts = router_logits.shape
    probs = torch.softmax(router_logits, dim=-1)
    chosen = probs.topk(top_k, dim=-1).indices
    counts = F.one_hot(chosen, experts).sum(dim=(0, 1)).to(probs.dtype)
    return experts / (top_k * tokens**2) * (counts * probs.sum(dim=0)).sum()


def reference_step(
    path: str, data, coeff: float, multiple: int, by_tokens: bool = True
) -> tuple[dict[str, torch.Tensor], float]:
    """The HF model in float64 after one SGD step (lr 1) on the mean token NLL plus
    ``coeff * A``, and ``A``: the micro-batches' summed-over-layers losses, each weighted by
    its tokens over the batch's. A micro-batch is ``MICRO`` rows as wide as its longest row,
    padded to a multiple of ``multiple`` (the tensor-parallel size with sequence parallelism);
    padding tokens attend to their row's real tokens and are routed and counted like them.
    ``by_tokens=False``: the micro-batches' plain mean instead (what the test tells apart)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    model.config._experts_implementation = "eager"
    mask = TrainBatch.from_transport(data).loss_token_mask()
    lengths = data["input_lengths"]
    micro_batches = []
    for start in range(0, len(lengths), MICRO):
        rows = slice(start, start + MICRO)
        width = int(lengths[rows].max())
        padded = -(-width // multiple) * multiple
        ids = F.pad(data["input_ids"][rows, :width], (0, padded - width))
        real = torch.arange(padded)[None, :] < lengths[rows, None]
        micro_batches.append((rows, width, ids, real))
    tokens = sum(ids.numel() for _, _, ids, _ in micro_batches)
    nll = torch.zeros((), dtype=torch.float64)
    aux = torch.zeros((), dtype=torch.float64)
    for rows, width, ids, real in micro_batches:
        out = model(ids, attention_mask=real.long(), output_router_logits=True)
        logp = torch.log_softmax(out.logits[:, : width - 1], dim=-1)
        logp = logp.gather(-1, ids[:, 1:width, None])[..., 0]
        nll = nll - (logp * mask[rows, 1:width]).sum() / mask.sum()
        layers = sum(switch_loss(r, model.config.num_experts_per_tok) for r in out.router_logits)
        aux = aux + layers * (ids.numel() / tokens if by_tokens else 1 / len(micro_batches))
    (nll + coeff * aux).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return model.state_dict(), float(aux.detach())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_step_with_its_load_balancing_loss_matches_float64(layout, tmp_path_factory, tmp_path):
    megatron, world = LAYOUTS[layout]
    path = save_tiny(tmp_path_factory, TINY_QWEN3_MOE)
    data = skewed_batch(lengths=LENGTHS)
    config = tiny_config(
        model={"path": path, "dtype": "float64"},
        backend="megatron",
        megatron={**megatron, "moe_aux_loss_coeff": COEFF},
        train_micro_batch_size=MICRO,
        dynamic_batching={"enabled": False},
    )
    cluster = RayVirtualCluster([world], use_gpus=False)
    policy = Policy(cluster, config)
    try:
        assert policy.dp_size == megatron.get("expert_parallel_size", 1)
        got = policy.get_logprobs(data)["logprobs"]
        torch.testing.assert_close(got, hf_logprobs(path, data), rtol=0, atol=ATOL)
        # An evaluation adds no load-balancing loss, so it reports none (not a 0); its loss
        # is the plain NLL.
        evaluated = policy.train(data, NLLLoss(), eval_mode=True).metrics
        assert "moe_aux_loss" not in evaluated
        mask = TrainBatch.from_transport(data).loss_token_mask()
        nll = float(-(hf_logprobs(path, data) * mask).sum() / mask.sum())
        assert evaluated["loss"][0] == pytest.approx(nll, rel=1e-6)
        policy.prepare_for_training()
        metrics = policy.train(data, NLLLoss()).metrics
        policy.prepare_for_lp_inference()
        ckpt = str(tmp_path / "ckpt")
        policy.save_checkpoint(ckpt)
    finally:
        policy.shutdown()
        cluster.shutdown()

    multiple = 2 if megatron.get("sequence_parallel") else 1
    expected, aux = reference_step(path, data, COEFF, multiple)
    assert aux > 0
    assert metrics["moe_aux_loss"][0] == pytest.approx(aux, rel=1e-6)
    # The micro-batches weigh by their tokens (80 and 72, or 68): a plain mean is told apart.
    _, plain_mean = reference_step(path, data, COEFF, multiple, by_tokens=False)
    assert abs(plain_mean - aux) > 1e-4 * aux
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()
    assert set(trained) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=ATOL, msg=name)
    # The load-balancing loss moved the routers: without it they would be elsewhere.
    without, _ = reference_step(path, data, 0.0, multiple)
    routers = [n for n in expected if n.endswith("mlp.gate.weight")]
    assert routers and all((without[n] - expected[n]).abs().max() > 1e-4 for n in routers)
