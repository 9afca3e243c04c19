"""FSDP2 with two data-parallel ranks (gloo): what only shows with more than one rank.

The ranks run ``two_rank_scenarios.py`` under ``torch.distributed.run``; each returns what it
computed on its half of the batch, and the tests hold that against one process.
"""

import os

import pytest
import torch

from .conftest import (
    TINY_LLAMA,
    check_the_one_process_step,
    grouped_batch,
    initial_model,
    scenario,
    scenario_results,
    sequence_logprobs,
    skewed_batch,
)
from .test_normalisation import weights_after_one_step
from .test_reward_model import reference_scores
from .test_token_entropy import float64_logprobs_and_entropy
from .two_rank_scenarios import (
    TENSOR_PARALLEL_CASES,
    asked_token_ids,
    context_parallel_config,
    long_documents,
    tensor_parallel_config,
    tensor_parallel_loss,
)

pytestmark = pytest.mark.slow  # one launch of two processes: ~2 min on 2 cores
SCRIPT = os.path.join(os.path.dirname(__file__), "two_rank_scenarios.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return scenario_results(2, SCRIPT, tmp_path_factory.mktemp("two-ranks"))


def test_reward_model_scores_with_two_ranks(ranks):
    """FSDP2 gathers the parameters in the model's forward: scoring must go through it."""
    got = torch.cat([r["scores"] for r in scenario(ranks, "reward_scores")])
    expected = reference_scores(skewed_batch(), num_labels=2)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_reference_policy_agrees_with_the_policy_at_step_zero_in_bf16(ranks):
    """Same sharding, same bf16 compute: KL(policy || reference) is exactly 0 before training."""
    for r in scenario(ranks, "bf16_reference"):
        assert r["policy_logprobs"].abs().sum() > 0
        torch.testing.assert_close(r["reference_logprobs"], r["policy_logprobs"], rtol=0, atol=0)


def test_gradients_are_reduced_once_per_step_and_give_the_one_process_step(ranks):
    ranks = scenario(ranks, "one_step")
    for r in ranks:
        # One reduce-scatter per FSDP group (decoder layers and the root), after the last of
        # the step's 4 micro-batches, not one per micro-batch.
        assert r["gradient_reductions"] == r["fsdp_groups"] == 3
    expected = weights_after_one_step(train_micro_batch_size=8)
    got = ranks[0]["trained_weights"]
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-10, msg=name)


def test_groups_share_their_prompt_pass_on_two_ranks(ranks, float64_norms):
    """Each rank runs its groups' prompts once under FSDP2; the step, and pi_old's log-probs
    at the loss's tokens before it, equal the float64 reference that runs every row alone."""
    from .test_shared_prefix import loss_token_logprobs, reference_step

    ranks = scenario(ranks, "shared_prefix_step")
    got_lp = torch.cat([r["loss_token_logprobs"] for r in ranks])
    expected_lp = loss_token_logprobs(grouped_batch().slice(0, 12))
    torch.testing.assert_close(got_lp, expected_lp, rtol=0, atol=1e-10)
    # One pass per rank over packed group rows, fewer tokens than the rank's 6 padded rows.
    for rank, r in enumerate(ranks):
        half = grouped_batch().slice(rank * 6, rank * 6 + 6)
        assert len(r["embedded"]) == 1 and r["embedded"][0] < half["input_ids"].numel()
        assert r["segments"] == TINY_LLAMA["num_hidden_layers"]  # attention by segments
    expected = reference_step(grouped_batch().slice(0, 12))
    for name, tensor in expected.items():
        got = ranks[0]["trained_weights"][name]
        torch.testing.assert_close(got, tensor, rtol=0, atol=1e-10, msg=name)


def test_gradients_are_freed_after_the_step(ranks):
    for r in scenario(ranks, "one_step"):
        assert all(r["grads_freed_after_step"])


def test_each_rank_drops_activations_from_its_own_stream(ranks):
    """Data-parallel ranks hold other rows (and tensor or context parallel ones other heads or
    tokens): sharing a stream would give them correlated dropout masks."""
    first, second = (r["dropout_draws"] for r in scenario(ranks, "one_step"))
    assert not torch.equal(first, second)


def test_no_rank_builds_the_whole_model(ranks):
    """Built on the meta device, each rank allocates its half plus one module at a time (plus
    allocator slack: ~0.75 of a copy measured, against ~1.1 before)."""
    for r in scenario(ranks, "build_memory"):
        assert r["build_peak_bytes"] < 0.9 * r["full_model_bytes"], r


def test_a_pretrained_model_is_loaded_in_slices_by_each_rank(ranks):
    from transformers import AutoModelForCausalLM

    got = torch.cat([r["logprobs"] for r in scenario(ranks, "pretrained")])
    data = skewed_batch()
    hf = initial_model(seed=3, hf_config={**TINY_LLAMA, "tie_word_embeddings": True}).eval()
    assert isinstance(hf, AutoModelForCausalLM._model_mapping[type(hf.config)])
    torch.testing.assert_close(got, sequence_logprobs(hf, data), rtol=0, atol=1e-10)


def test_a_critic_on_two_ranks_values_and_trains_like_one_process(ranks, tmp_path):
    """Built from a causal LM's files in slices (its value head drawn from the seed), the
    two-rank critic's values and its step equal one process's."""
    from .test_critic import reference_values
    from .two_rank_scenarios import critic_step

    results = scenario(ranks, "critic_step")
    initial_model(seed=3, hf_config={**TINY_LLAMA, "tie_word_embeddings": True}).save_pretrained(
        tmp_path / "pretrained"
    )
    one = critic_step(skewed_batch(), str(tmp_path))
    for key in ("values", "final_values", "trained_values"):
        got = torch.cat([r[key] for r in results])
        torch.testing.assert_close(got, one[key], rtol=0, atol=1e-10, msg=key)
    assert float((one["trained_values"] - one["values"]).abs().max()) > 1e-3
    values, _ = reference_values(critic_model(tmp_path / "pretrained", seed=4), skewed_batch())
    torch.testing.assert_close(one["values"], values, rtol=0, atol=1e-10)


def test_a_reward_model_from_a_causal_lm_scores_on_two_ranks_like_one_process(ranks, tmp_path):
    """Built from a causal LM's files in slices, its score head (absent from the files) drawn
    from the seed: the two ranks' scores equal one process's build."""
    from rl_models.modeling.build import build_model
    from rl_models.modeling.config import ModelConfig

    from .test_reward_model import scores_of

    results = scenario(ranks, "reward_from_lm")
    got = torch.cat([r["scores"] for r in results])
    lm = initial_model(seed=3, hf_config={**TINY_LLAMA, "tie_word_embeddings": True})
    lm.save_pretrained(tmp_path)
    one = ModelConfig(path=str(tmp_path), kind="sequence_classification", dtype="float64")
    model = build_model(one, seed=4).eval()
    expected = scores_of(model, skewed_batch())
    assert expected.abs().sum() > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    # Its sharded checkpoint holds the drawn head and names the reward model's class, not
    # the causal LM's its files came from.
    assert results[0]["saved_architectures"] == ["LlamaForSequenceClassification"]
    torch.testing.assert_close(results[0]["saved_score"], model.score.weight, rtol=0, atol=0)


def test_a_teacher_gives_the_top_k_of_one_whole_process_on_two_ranks(ranks):
    """FSDP2 shards the teacher; its chunked top-k of each rank's half of the batch equals the
    top-k of the plain float64 model's whole log-softmax."""
    from .test_topk_logprobs import real_positions, whole_model_log_softmax

    halves = scenario(ranks, "teacher_topk")
    data = skewed_batch()
    want_values, want_ids = whole_model_log_softmax(data).topk(5, dim=-1)
    real = real_positions(data)
    # The halves may be padded to different widths: compare each on its own rows.
    for rank, half in enumerate(halves):
        rows = slice(rank * 4, rank * 4 + 4)
        width = half["topk_ids"].shape[1]
        on = real[rows, :width]
        assert torch.equal(half["topk_ids"][on], want_ids[rows, :width][on])
        torch.testing.assert_close(
            half["topk_logprobs"][on], want_values[rows, :width][on], rtol=0, atol=1e-10
        )
        assert int(on.sum()) == int(real[rows].sum())  # no real position left out


def critic_model(path, seed: int):
    from rl_models.modeling.build import build_model
    from rl_models.modeling.config import ModelConfig

    return build_model(ModelConfig(path=str(path), kind="value", dtype="float64"), seed)


def test_both_ranks_write_their_own_rows_into_the_shared_weight_region(ranks):
    """Shared-memory refit channel: no gather, each rank writes its rows (about half the bytes),
    and the region equals the trained model exactly, uneven shards included."""
    results = scenario(ranks, "region_write")
    total = sum(t.numel() * t.element_size() for t in results[0]["full"].values())
    assert sum(r["bytes_written"] for r in results) == total
    assert all(r["bytes_written"] > 0.4 * total for r in results)
    full = results[0]["full"]  # gathered onto rank 0 only
    for r in results:  # both ranks map the same memory
        assert set(r["region"]) == set(full)
        for name, tensor in full.items():
            assert torch.equal(r["region"][name], tensor), name


@pytest.mark.parametrize("case", TENSOR_PARALLEL_CASES)
def test_tensor_parallel_logprobs_and_entropies_equal_float64(ranks, case):
    """tp=2 (sequence parallel, packed in some cases): each rank's vocabulary half of the
    output layer, the log-softmax all-reduced; equal to the plain float64 model run on each
    sequence alone, on both ranks: log-probs and entropies, log-probs at asked token ids (a
    distillation student's at its teacher's top-k) and the top-k (a teacher's)."""
    from rl_models.modeling.build import build_model

    config = tensor_parallel_config(case, tp=False)
    hf = build_model(config.model, config.seed).eval()
    data = skewed_batch()
    asked = asked_token_ids(data)
    expected = torch.zeros(*data["input_ids"].shape, 2, dtype=torch.float64)
    expected_gathered = torch.zeros(*asked.shape[:2], 1 + asked.shape[2], dtype=torch.float64)
    expected_top = torch.zeros(*asked.shape[:2], 5, dtype=torch.float64)
    expected_ids = torch.zeros(*asked.shape[:2], 5, dtype=torch.long)
    with torch.no_grad():
        for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
            logits = hf(ids[None, :n]).logits[0, :-1]
            expected[row, 1:n] = float64_logprobs_and_entropy(logits, ids[1:n])
            tokens = torch.cat([ids[1:n, None], asked[row, 1:n]], -1)
            expected_gathered[row, 1:n] = torch.log_softmax(logits, -1).gather(-1, tokens)
            expected_top[row, 1:n], expected_ids[row, 1:n] = logits.log_softmax(-1).topk(5)
    for r in scenario(ranks, f"tensor_parallel/{case}"):
        torch.testing.assert_close(r["logprobs_entropy"], expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(r["gathered"], expected_gathered, rtol=0, atol=1e-10)
        torch.testing.assert_close(r["topk"]["topk_logprobs"], expected_top, rtol=0, atol=1e-10)
        assert torch.equal(r["topk"]["topk_ids"], expected_ids)


@pytest.mark.parametrize("case", TENSOR_PARALLEL_CASES)
def test_a_tensor_parallel_step_exports_and_saves_the_one_process_weights(ranks, case):
    """One SGD step at tp=2 gives one process's gradient norm and weights (clipped in the
    ``clipped`` cases): exported in buckets (full tensors under their Hugging Face names, a
    tied output layer once) and saved as a checkpoint that ``from_pretrained`` reads."""
    from rl_models.policy.dtensor_worker import DTensorPolicyWorker

    worker = DTensorPolicyWorker(tensor_parallel_config(case, tp=False))
    initial = {k: v.clone() for k, v in worker.model.state_dict().items()}
    grad_norm = worker.train(skewed_batch(), tensor_parallel_loss(case)).metrics["grad_norm"]
    if "clipped" in case:  # the norm well above the bound: the step is scaled down
        assert grad_norm[0] > 1.5 * worker.config.max_grad_norm
    expected = worker.model.state_dict()
    moved = {k: float((expected[k] - initial[k]).abs().max()) for k in expected}
    assert max(moved.values()) > 1e-2
    # Qwen3's per-head query and key norms train too (1.3e-3 to 3.8e-3): their weights below
    # would show a gradient left as one rank's heads' share (~1.5e-3 off, checked).
    head_norms = [k for k in moved if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert all(moved[k] > 1e-3 for k in head_norms)
    assert bool(head_norms) == case.startswith("qwen3")
    result = scenario(ranks, f"tensor_parallel/{case}")[0]  # rank 0: the producer
    assert result["grad_norm"] == pytest.approx(grad_norm, rel=1e-12)
    tied = worker.config.model.hf_config.get("tie_word_embeddings", False)
    assert set(result["exported"]) == set(expected) - ({"lm_head.weight"} if tied else set())
    assert set(result["checkpoint"]) == set(expected)
    for weights in (result["exported"], result["checkpoint"]):
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("case", TENSOR_PARALLEL_CASES)
def test_no_tensor_parallel_rank_holds_logits_of_the_whole_vocabulary(ranks, case):
    """At tp=2 the log-probs, the top-k and the step (chunks of 7 tokens, recomputed in
    backward) compute each rank's half of the vocabulary's columns only: while they run, no
    tensor on either rank is as wide as the whole vocabulary (gathering the logits fails here,
    checked). Qwen3's vocabulary half (75) is no other dimension of its model, so there the
    logits themselves show: on every rank, at most one chunk's rows of them at a time."""
    for r in scenario(ranks, f"tensor_parallel/{case}"):
        assert r["whole_vocab_rows"] == 0
        if case.startswith("qwen3"):
            assert 0 < r["half_vocab_rows"] <= 7


def test_context_parallel_packed_row_gives_float64_logprobs_and_the_one_process_step(ranks):
    """cp=2 on one packed row of three uneven documents (plus padding): each rank runs half
    of the row's tokens, attending to the other half's keys under the documents' causal mask.
    Both ranks' log-probs (entropies, top-k) equal the plain float64 model run on each
    document alone, and one
    SGD step gives one process's gradient norm and weights: a dropped document mask or a
    gradient counted on both ranks (twice the norm) fails here (checked)."""
    from rl_models.modeling.build import build_model

    data = long_documents()
    config = context_parallel_config(cp=False)
    hf = build_model(config.model, config.seed).eval()
    expected = torch.zeros(*data["input_ids"].shape, 2, dtype=torch.float64)
    expected_top = torch.zeros(*data["input_ids"].shape, 5, dtype=torch.float64)
    expected_ids = torch.zeros(*data["input_ids"].shape, 5, dtype=torch.long)
    with torch.no_grad():
        for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
            logits = hf(ids[None, :n]).logits[0, :-1]
            expected[row, 1:n] = float64_logprobs_and_entropy(logits, ids[1:n])
            expected_top[row, 1:n], expected_ids[row, 1:n] = logits.log_softmax(-1).topk(5)
    results = scenario(ranks, "context_parallel")
    for r in results:
        torch.testing.assert_close(r["logprobs"], expected[..., 0], rtol=0, atol=1e-10)
        torch.testing.assert_close(r["entropy"], expected[..., 1], rtol=0, atol=1e-10)
        torch.testing.assert_close(r["topk"]["topk_logprobs"], expected_top, rtol=0, atol=1e-10)
        assert torch.equal(r["topk"]["topk_ids"], expected_ids)
    check_the_one_process_step(config, data, results, "trained_weights")
