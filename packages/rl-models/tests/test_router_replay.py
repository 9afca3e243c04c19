"""Router replay on a tiny Qwen3-MoE built from its config (float64): the HF generator records
the experts each token was routed to, and the DTensor policy, told to replay them, routes every
token to those experts even where its own router would choose others. Checked against a
float64 recomputation by hand (softmax and top-k over the router weights; the MoE block's sum
over the recorded experts)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.config import SamplingConfig
from rl_models.generation.sampling import sample
from rl_models.losses import NLLLoss
from rl_models.modeling.build import build_model
from rl_models.modeling.moe_routes import NO_ROUTE, RouteReplay, moe_routers
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import TINY_LLAMA, tiny_config

# Three decoder layers, the middle one dense: the routes' layer dimension counts MoE layers only.
TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    # The grouped-matmul experts kernel has no float64; the loop over experts computes the same.
    "experts_implementation": "eager",
}
MODEL = {"hf_config": TINY_QWEN3_MOE, "dtype": "float64"}


def moe_config(**overrides):
    return tiny_config(model=MODEL, share_prompt_prefix=False, **overrides)


@pytest.fixture(scope="module")
def generated():
    """A generator's samples with routes: a shared prompt (two rows), prompts of uneven
    lengths (left-padded inside the sampler), one row cut short by a stop token."""
    model = build_model(moe_config().model, 0).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 9, 0], [9, 10, 0, 0, 0, 0], [3] * 6])
    lengths = torch.tensor([5, 5, 2, 6])
    out = sample(
        model,
        ids,
        lengths,
        SamplingConfig(max_new_tokens=7),
        stop_token_ids=[30],  # row 0 samples it third
        row_seeds=[1, 2, 3, 4],
        record_routes=True,
    )
    return model, lengths, out


def float64_routes(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[T, layers, k]`` of one unpadded sequence by hand: each router's input hidden states
    (read off the model's forward), then softmax and top-k over its weights in float64."""
    routers, inputs = moe_routers(model), []
    handles = [
        r.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
        for r in routers
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids[None])
    finally:
        for h in handles:
            h.remove()
    out = []
    for router, h in zip(routers, inputs, strict=True):
        z = h.reshape(-1, h.shape[-1]).double() @ router.weight.double().T
        p = torch.exp(z - z.max(-1, keepdim=True).values)
        p = p / p.sum(-1, keepdim=True)
        out.append(p.argsort(-1, descending=True)[:, : router.top_k])
    return torch.stack(out, dim=1)


def test_recorded_routes_equal_a_float64_recomputation(generated):
    model, lengths, out = generated
    routes = out.routed_experts
    assert routes.dtype == torch.int16
    assert routes.shape == (*out.output_ids.shape, 2, 2)  # 2 MoE layers of 3, top-2
    assert bool((out.generation_lengths < 7).any())  # a row stopped early: its tail is padding
    for i, (n, g) in enumerate(zip(lengths.tolist(), out.generation_lengths.tolist(), strict=True)):
        total = n + g
        expected = float64_routes(model, out.output_ids[i, :total])
        # Every token that went through the model: prompt (prefill) and fed-back response.
        assert torch.equal(routes[i, : total - 1].long(), expected[: total - 1]), f"row {i}"
        # The last token was never fed back; padding has no token.
        assert bool((routes[i, total - 1 :] == NO_ROUTE).all())


def test_prompts_opening_alike_are_prefilled_whole_when_routes_are_recorded():
    """Two prompts opening with the same 70 tokens would have that prefix prefilled once; the
    routes are recorded per prompt column, so they are prefilled whole, and every prompt
    token's routes are the float64 recomputation's."""
    model = build_model(moe_config().model, 0).eval()
    head = torch.randint(1, 128, (70,), generator=torch.Generator().manual_seed(2))
    ids = torch.stack([torch.cat([head, torch.tensor([t, t + 1])]) for t in (3, 9)])
    out = sample(
        model,
        ids,
        torch.tensor([72, 72]),
        SamplingConfig(max_new_tokens=3),
        stop_token_ids=[],
        row_seeds=[1, 2],
        record_routes=True,
    )
    for i in range(2):
        total = 72 + int(out.generation_lengths[i])
        expected = float64_routes(model, out.output_ids[i, :total])
        assert torch.equal(out.routed_experts[i, : total - 1].long(), expected[: total - 1])


def replay_batch(generated) -> BatchedDataDict:
    _, lengths, out = generated
    return BatchedDataDict(
        input_ids=out.output_ids,
        input_lengths=lengths + out.generation_lengths,
        routed_experts=out.routed_experts,
    )


def perturb_routers(model: torch.nn.Module, scale: float = 0.5) -> None:
    """Router weights moved by a fixed draw: enough to change some tokens' top-k."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_routers(model):
            noise = torch.randn(router.weight.shape, generator=gen, dtype=router.weight.dtype)
            router.weight += scale * router.weight.std() * noise


def hand_moe_forward(block: torch.nn.Module, routes: torch.Tensor):
    """A Qwen3-MoE block's forward by hand in float64 over the experts ``routes`` names
    (``[tokens, k]``; -1: the router's own top-k): weights are the router softmax at those
    experts, renormalised; each expert is a SwiGLU of its own weights."""
    gate_w, experts = block.gate.weight, block.experts

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        z = h @ gate_w.T
        p = torch.exp(z - z.max(-1, keepdim=True).values)
        p = p / p.sum(-1, keepdim=True)
        own = p.argsort(-1, descending=True)[:, : routes.shape[-1]]
        chosen = torch.where(routes >= 0, routes.long(), own)
        w = p.gather(-1, chosen)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            for j in range(chosen.shape[1]):
                e = int(chosen[t, j])
                gate, up = (experts.gate_up_proj[e] @ h[t]).chunk(2)
                y = experts.down_proj[e] @ (F.silu(gate) * up)
                out[t] = out[t] + w[t, j] * y
        return out.reshape(hidden.shape)

    return forward


def hand_logprobs(model: torch.nn.Module, batch: BatchedDataDict) -> torch.Tensor:
    """``[B, S]`` next-token log-probs, row by row unpadded, every MoE block computed by hand
    over the batch's recorded experts (0 at position 0 and on padding)."""
    ids, lengths, routes = batch["input_ids"], batch["input_lengths"], batch["routed_experts"]
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    out = torch.zeros(ids.shape, dtype=torch.float64)
    for i, n in enumerate(lengths.tolist()):
        originals = [b.forward for b in blocks]
        for layer, b in enumerate(blocks):
            b.forward = hand_moe_forward(b, routes[i, :n, layer])
        try:
            logits = model(input_ids=ids[i : i + 1, :n]).logits[0].double()
        finally:
            for b, f in zip(blocks, originals, strict=True):
                b.forward = f
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[i, 1:n, None])[:, 0]
        out[i, 1:n] = lp
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_replay_routes_the_trainer_through_the_generators_experts(generated, packed):
    batch = replay_batch(generated)
    batching = {
        "sequence_packing": {"enabled": packed, "max_tokens_per_microbatch": 64},
        "dynamic_batching": {"enabled": "auto" if packed else False},  # padded: rows in order
    }
    replaying = DTensorPolicyWorker(moe_config(router_replay=True, **batching))
    own = DTensorPolicyWorker(moe_config(**batching))
    for worker in (replaying, own):
        perturb_routers(worker.model)
    # The perturbed routers choose other experts for some tokens than the generator did.
    chosen_by_own = [
        float64_routes(own.model, batch["input_ids"][i, :n])
        for i, n in enumerate(batch["input_lengths"].tolist())
    ]
    recorded = batch["routed_experts"]
    differs = [
        bool((r[:-1] != recorded[i, : len(r) - 1].long()).any())
        for i, r in enumerate(chosen_by_own)
    ]
    assert any(differs)

    # Which experts the replaying model's experts ran, per MoE layer ([B * S, k] in the padded
    # micro-batch's row order; a packed row's order is the packing plan's, so only the
    # log-probs below are compared there).
    ran: list[torch.Tensor] = []
    experts = [m for m in replaying.model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    handles = [e.register_forward_pre_hook(lambda m, a: ran.append(a[1].clone())) for e in experts]
    try:
        lp = replaying.get_logprobs(batch)["logprobs"]
    finally:
        for h in handles:
            h.remove()
    if not packed:
        assert len(ran) == 2
        for layer, used in enumerate(ran):
            used = used.view(*recorded.shape[:2], -1)
            known = recorded[:, :, layer] >= 0
            assert torch.equal(used[known], recorded[:, :, layer][known].long())

    with torch.no_grad():
        expected = hand_logprobs(replaying.model, batch)
    torch.testing.assert_close(lp, expected, rtol=0, atol=1e-10)
    # Without replay the same perturbed weights give other log-probs.
    assert float((own.get_logprobs(batch)["logprobs"] - expected).abs().max()) > 1e-6


def test_gradients_reach_the_router_through_the_replayed_weights(generated):
    batch = replay_batch(generated)
    model, _, _ = generated
    replayed, reference = copy.deepcopy(model), copy.deepcopy(model)
    for m in (replayed, reference):
        perturb_routers(m)
        m.train()
    i = 0
    n = int(batch["input_lengths"][i])
    ids = batch["input_ids"][i : i + 1, :n]
    with RouteReplay(replayed, batch["routed_experts"][i : i + 1, :n]):
        logits = replayed(input_ids=ids).logits[0]
    torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).sum().backward()
    hand_logprobs(reference, {k: v[i : i + 1] for k, v in batch.items()}).sum().backward()
    for got, want in zip(moe_routers(replayed), moe_routers(reference), strict=True):
        assert float(got.weight.grad.abs().max()) > 0
        torch.testing.assert_close(got.weight.grad, want.weight.grad, rtol=0, atol=1e-10)
    # Outside the block the model routes by itself again (the hooks are gone).
    assert all(not r._forward_hooks for r in moe_routers(replayed))


def test_a_train_step_with_recomputed_activations_replays_in_backward_too(generated):
    """One SGD step (lr 1) of the NLL with activation checkpointing: the recomputation in
    backward must route as the forward did, so the router weights after the step are those
    of the hand-written MoE over the recorded experts."""
    batch = replay_batch(generated)
    config = moe_config(
        router_replay=True, activation_checkpointing=True, dynamic_batching={"enabled": False}
    )
    worker = DTensorPolicyWorker(config)
    perturb_routers(worker.model)
    reference = copy.deepcopy(worker.model).train()
    # hand_logprobs swaps the MoE forwards only while it runs: no recomputation after it.
    reference.gradient_checkpointing_disable()
    worker.train(batch, NLLLoss())

    lp = hand_logprobs(reference, batch)
    mask = TrainBatch.from_transport(batch).loss_token_mask()
    (-(lp * mask).sum() / mask.sum()).backward()
    for got, want in zip(moe_routers(worker.model), moe_routers(reference), strict=True):
        step = want.weight.detach() - want.weight.grad
        assert float(want.weight.grad.abs().max()) > 0
        torch.testing.assert_close(got.weight.detach(), step, rtol=0, atol=1e-10)


def test_router_replay_on_a_dense_model_is_refused_by_name():
    with pytest.raises(ValueError, match=r"router_replay needs a mixture-of-experts model.*Llama"):
        DTensorPolicyWorker(
            tiny_config(model={"hf_config": TINY_LLAMA, "dtype": "float64"}, router_replay=True)
        )


def test_a_batch_without_routes_is_refused_when_replaying(generated):
    batch = replay_batch(generated)
    del batch["routed_experts"]
    worker = DTensorPolicyWorker(moe_config(router_replay=True))
    with pytest.raises(KeyError, match=r"no .routed_experts.*record_routed_experts"):
        worker.get_logprobs(batch)
