"""TrainBatch: one name per field, refused keys at the boundary, and the loss-token mask."""

import pytest
import torch

from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict


def small_batch() -> TrainBatch:
    return TrainBatch(
        input_ids=torch.tensor([[5, 6, 7, 8], [5, 9, 0, 0], [1, 2, 3, 0]]),
        input_lengths=torch.tensor([4, 2, 3]),
        loss_mask=torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0], [0, 1, 1, 1]]),
        sample_mask=torch.tensor([1.0, 1.0, 0.0]),
        advantages=torch.randn(3, 4),
    )


def test_transport_round_trip_keeps_every_field_and_only_those_present():
    batch = small_batch()
    data = batch.to_transport()
    assert isinstance(data, BatchedDataDict)
    assert set(data) == {"input_ids", "input_lengths", "loss_mask", "sample_mask", "advantages"}
    back = TrainBatch.from_transport(data)
    for name in batch.present():
        assert torch.equal(getattr(back, name), getattr(batch, name))
    assert back.prev_logprobs is None


@pytest.mark.parametrize("old_name", ["token_mask", "reference_policy_logprobs", "teacher_topk"])
def test_a_key_that_is_no_field_is_refused_by_name(old_name):
    data = small_batch().to_transport()
    data[old_name] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=f"'{old_name}'.*not TrainBatch fields"):
        TrainBatch.from_transport(data)


def test_an_old_name_says_the_new_one():
    data = small_batch().to_transport()
    data["token_mask"] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="'token_mask' is now 'loss_mask'"):
        TrainBatch.from_transport(data)
    with pytest.raises(TypeError, match=r"batch\.reference_logprobs.*is now"):
        small_batch()["reference_policy_logprobs"]


def test_extras_travel_under_their_prefix_and_come_back():
    batch = small_batch().replace(extras={"target": torch.arange(3.0)})
    data = batch.to_transport()
    assert torch.equal(data["extras.target"], torch.arange(3.0))
    back = TrainBatch.from_transport(data.slice(1, 3))
    assert back.extras["target"].tolist() == [1.0, 2.0]
    assert back.select([1]).extras["target"].tolist() == [2.0]


def test_a_field_with_the_wrong_number_of_rows_is_refused():
    with pytest.raises(ValueError, match="advantages has 2 rows but input_ids has 3"):
        small_batch().replace(advantages=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"extras\.target has 4 rows"):
        small_batch().replace(extras={"target": torch.zeros(4)})


def test_a_batch_without_ids_is_refused():
    with pytest.raises(ValueError, match="'input_lengths'"):
        TrainBatch.from_transport({"input_ids": torch.zeros(2, 3, dtype=torch.long)})


def test_loss_token_mask_matches_a_plain_loop():
    batch = small_batch()
    mask = batch.loss_token_mask()
    assert mask.dtype == torch.float64
    for b in range(batch.size):
        for t in range(batch.input_ids.shape[1]):
            counts = (
                0 < t < int(batch.input_lengths[b])
                and batch.loss_mask[b, t] == 1
                and batch.sample_mask[b] == 1
            )
            assert mask[b, t] == float(counts), (b, t)


def test_without_masks_every_real_token_but_the_first_counts():
    batch = TrainBatch(
        input_ids=torch.ones(2, 3, dtype=torch.long), input_lengths=torch.tensor([3, 1])
    )
    assert batch.loss_token_mask().tolist() == [[0, 1, 1], [0, 0, 0]]
    assert batch.sample_valid_mask().tolist() == [1.0, 1.0]


def test_need_names_the_reader_and_the_missing_field():
    with pytest.raises(KeyError, match=r"MyLoss needs 'prev_logprobs' \[B, S\]"):
        small_batch().need("prev_logprobs", "MyLoss", "[B, S]")
    assert small_batch().need("advantages", "MyLoss").shape == (3, 4)


def test_select_and_replace():
    batch = small_batch()
    picked = batch.select([2, 0])
    assert picked.input_lengths.tolist() == [3, 4]
    assert torch.equal(picked.advantages, batch.advantages[[2, 0]])
    with pytest.raises(TypeError):
        batch.replace(token_mask=batch.loss_mask)
    assert batch.replace(prev_logprobs=torch.zeros(3, 4)).prev_logprobs is not None
    assert batch.prev_logprobs is None  # replace copies
