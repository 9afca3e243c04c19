"""The DTensor worker on four gloo ranks: a ``dp x tp = 2 x 2`` mesh (FSDP2 over two data-parallel
ranks, each split by tensor and sequence parallelism) and a ``dp x cp x tp = 1 x 2 x 2`` one
(each half of a packed row's tokens split by tensor and sequence parallelism again).

The ranks run ``four_rank_scenarios.py`` under ``torch.distributed.run``. Every rank's
log-probs and entropies must equal the plain float64 model run on each sequence alone, and one
SGD step must give one process's gradient norm and weights (the checkpoint rank 0 reads back,
written in shards by each rank in the three-dimensional case, and the weights a refit exports);
a loss over whole logits (label smoothing) must give its float64 value, and on cp x tp a step
through it must give one process's gradient norm.
A gradient reduced over the wrong ranks (counted twice over tp, or missing a dp or cp rank's
share) changes the norm and the weights far beyond the tolerance.
"""

import os

import pytest
import torch

from rl_data.batch import TrainBatch

from .conftest import check_the_one_process_step, scenario, scenario_results
from .four_rank_scenarios import CASES, SMOOTHING, case_config, case_data
from .test_token_entropy import float64_logprobs_and_entropy

pytestmark = pytest.mark.slow  # one launch of four processes
SCRIPT = os.path.join(os.path.dirname(__file__), "four_rank_scenarios.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return scenario_results(4, SCRIPT, tmp_path_factory.mktemp("four-ranks"))


@pytest.mark.parametrize("case", CASES)
def test_a_mesh_gives_float64_logprobs_and_the_one_process_step(ranks, case):
    from rl_models.modeling.build import build_model

    data = case_data(case)
    config = case_config(case, parallel=False)
    hf = build_model(config.model, config.seed).eval()
    expected = torch.zeros(*data["input_ids"].shape, 2, dtype=torch.float64)
    mean_nll_over_vocab = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
            logits = hf(ids[None, :n]).logits[0, :-1]
            expected[row, 1:n] = float64_logprobs_and_entropy(logits, ids[1:n])
            mean_nll_over_vocab[row, 1:n] = -torch.log_softmax(logits.double(), -1).mean(-1)
    results = scenario(ranks, case)
    for rank, r in enumerate(results):
        rows = slice(None)
        if case.startswith("dp2"):  # each dp rank's half of the rows
            half = data.size // 2
            rows = slice((rank // 2) * half, (rank // 2 + 1) * half)
        torch.testing.assert_close(r["logprobs_entropy"], expected[rows], rtol=0, atol=1e-10)

    # A loss over whole logits (gathered over tp, then over cp): label-smoothed NLL, written
    # out as (1 - eps) * NLL + eps * mean over the vocabulary of -log p, per loss token.
    mask = TrainBatch.from_transport(data).loss_token_mask()
    per_token = -(1 - SMOOTHING) * expected[..., 0] + SMOOTHING * mean_nll_over_vocab
    smoothed = float((per_token * mask).sum() / mask.sum())
    for r in results:
        assert r["whole_logits_loss"][0] == pytest.approx(smoothed, rel=1e-10)
    if case == "cp2-tp2-sp":
        # The step through whole logits against one process's, and the NLL step's
        # max_grad_norm of 0.5 clips.
        from rl_models.losses import LabelSmoothedNLLLoss
        from rl_models.policy.dtensor_worker import DTensorPolicyWorker

        one = DTensorPolicyWorker(config).train(data, LabelSmoothedNLLLoss(SMOOTHING))
        for r in results:
            assert r["whole_logits_grad_norm"] == pytest.approx(one.metrics["grad_norm"], rel=1e-12)
        assert all(r["grad_norm"][0] > 0.5 for r in results)
    check_the_one_process_step(config, data, results, "checkpoint", "exported")
