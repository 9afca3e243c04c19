"""Per-row sampling seeds (``generation/seeds.py``): what makes a resumed run sample exactly
what the uninterrupted one sampled, on both backends."""

import pytest
import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation import SamplingConfig
from rl_models.generation.seeds import SEEDS_KEY, SamplingSeeds, seeds_of
from rl_models.generation.vllm.sampling import request_kwargs
from rl_models.modeling.random_streams import row_seed

from .test_hf_generation import peaky_model_dir, prompts, worker


def batch(rows: int) -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.ones(rows, 2, dtype=torch.long), input_lengths=torch.full((rows,), 2)
    )


def test_calls_are_numbered_within_a_weight_version_and_a_fresh_counter_numbers_them_again():
    run = SamplingSeeds(seed=7)
    v3_first, v3_second = run.next_call(3, 4), run.next_call(3, 4)
    v4_first = run.next_call(4, 4)
    assert v3_first.dtype == torch.int64 and len(set(v3_first.tolist())) == 4
    assert not set(v3_first.tolist()) & set(v3_second.tolist())
    assert not set(v3_first.tolist()) & set(v4_first.tolist())
    # What a resumed run does: a new counter, the version restored from the checkpoint.
    resumed = SamplingSeeds(seed=7)
    assert torch.equal(resumed.next_call(4, 4), v4_first)
    assert torch.equal(resumed.next_call(4, 2), run.next_call(4, 2))
    assert v3_first.tolist() == [row_seed(7, 3, 0, row) for row in range(4)]
    assert not torch.equal(SamplingSeeds(seed=8).next_call(3, 4), v3_first)


def test_greedy_calls_and_batches_with_their_own_seeds_count_no_call():
    run, ref = SamplingSeeds(seed=0), SamplingSeeds(seed=0)
    data = batch(3)
    assert run.seeded(data, greedy=True, weight_version=1) is data  # validation: nothing drawn
    own = BatchedDataDict(data)
    own[SEEDS_KEY] = torch.tensor([1, 2, 3])
    assert run.seeded(own, greedy=False, weight_version=1) is own
    seeded = run.seeded(data, greedy=False, weight_version=1)
    assert SEEDS_KEY not in data  # the caller's batch is not changed
    assert torch.equal(seeded[SEEDS_KEY], ref.next_call(1, 3))  # still call 0 at version 1


def test_malformed_seeds_are_named():
    data = batch(3)
    data[SEEDS_KEY] = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"sampling_seeds.*one seed per row \(3\)"):
        seeds_of(data)


def test_a_seeded_hf_row_samples_the_same_whatever_shares_its_batch(tmp_path):
    gen = worker(peaky_model_dir(tmp_path), temperature=1.0, max_new_tokens=8)
    data = prompts(lengths=(3, 7, 1, 5))
    data[SEEDS_KEY] = torch.tensor([11, 12, 13, 14])
    full = gen.generate(data)
    # Rows 3 and 0 alone, in the other order, after the worker sampled other things: the
    # same responses, because each row draws from its own seed only.
    gen.generate(prompts(lengths=(2, 2)))
    part = BatchedDataDict({k: v[[3, 0]] for k, v in data.items()})
    again = gen.generate(part)
    for mine, theirs in ((0, 1), (3, 0)):
        n = int(full["unpadded_sequence_lengths"][mine])
        assert n == int(again["unpadded_sequence_lengths"][theirs])
        assert torch.equal(full["output_ids"][mine, :n], again["output_ids"][theirs, :n])
        assert torch.equal(full["logprobs"][mine, :n], again["logprobs"][theirs, :n])
    # Another seed, another sample (8 tokens from a far-from-peaked model: never all equal).
    other = BatchedDataDict(data)
    other[SEEDS_KEY] = torch.tensor([21, 22, 23, 24])
    assert not torch.equal(gen.generate(other)["output_ids"], full["output_ids"])


def test_vllm_requests_carry_each_rows_seed_except_greedy_and_unseeded_ones():
    data = batch(3)
    data["stop_strings"] = [None, ["x"], None]
    data[SEEDS_KEY] = torch.tensor([5, 6, 2**62])
    config = SamplingConfig(temperature=0.9)
    kwargs = request_kwargs(config, False, [2], data)
    assert [k["seed"] for k in kwargs] == [5, 6, 2**62]
    assert [k["stop"] for k in kwargs] == [[], ["x"], []]
    assert [k["seed"] for k in request_kwargs(config, True, [2], data)] == [None] * 3
    del data[SEEDS_KEY]  # a stream (async GRPO): the engine's own generator samples it
    assert [k["seed"] for k in request_kwargs(config, False, [2], data)] == [None] * 3
