"""What the loss tests share: a batch's loss computed whole and in micro-batches."""

import pytest
import torch

from rl_data.batch import TrainBatch


def _split_matches_whole(loss_fn, lp, data, cuts, seqs, toks):
    """Asserts that ``loss_fn`` over the micro-batches ``cuts`` (with the global counts) sums
    to the whole batch's loss and gradient; returns the whole batch's metrics and the parts'."""
    whole, whole_metrics = loss_fn(lp, TrainBatch.from_transport(data), seqs, toks)
    (whole_grad,) = torch.autograd.grad(whole, lp)
    total, parts = 0.0, []
    for start, end in cuts:
        part, m = loss_fn(
            lp[start:end], TrainBatch.from_transport(data.slice(start, end)), seqs, toks
        )
        total = total + part
        parts.append(m)
    (split_grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-14)
    return whole_metrics, parts


@pytest.fixture
def split_matches_whole():
    return _split_matches_whole
