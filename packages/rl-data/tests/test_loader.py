import json

import pytest
import torch

from rl_data.loader import StatefulDataLoader


def collect(loader, n):
    out, it = [], iter(loader)
    while len(out) < n:
        try:
            out.append(next(it))
        except StopIteration:
            it = iter(loader)
    return out


def test_each_epoch_is_a_seeded_permutation():
    loader = StatefulDataLoader(list(range(10)), batch_size=2, seed=3)
    epoch0 = [x for b in loader for x in b]
    epoch1 = [x for b in loader for x in b]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    g = torch.Generator().manual_seed(3)
    assert epoch0 == torch.randperm(10, generator=g).tolist()  # independent recomputation
    assert epoch1 == torch.randperm(10, generator=g).tolist()
    assert epoch0 == [x for b in StatefulDataLoader(list(range(10)), 2, seed=3) for x in b]


@pytest.mark.parametrize("stop_after", [0, 1, 4, 5, 7, 13])
def test_resume_sees_exactly_the_batches_an_uninterrupted_run_would(stop_after):
    data = list(range(11))  # 5 batches of 2 per epoch, one sample dropped
    reference = collect(StatefulDataLoader(data, 2, seed=1), 20)

    first = StatefulDataLoader(data, 2, seed=1)
    seen = collect(first, stop_after) if stop_after else []
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint survives serialising

    resumed = StatefulDataLoader(data, 2, seed=999)  # the checkpoint's seed wins
    resumed.load_state_dict(state)
    seen += collect(resumed, 20 - stop_after)
    assert seen == reference


def test_drop_last_and_sizes():
    assert len(StatefulDataLoader(list(range(11)), 2)) == 5
    assert [
        len(b) for b in StatefulDataLoader(list(range(11)), 2, shuffle=False, drop_last=False)
    ] == [2] * 5 + [1]
    assert [b for b in StatefulDataLoader(list(range(4)), 2, shuffle=False)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="fewer than one batch"):
        StatefulDataLoader([1], 2)


def test_resume_refuses_a_different_dataset():
    state = StatefulDataLoader(list(range(10)), 2).state_dict()
    with pytest.raises(ValueError, match="dataset_size is 10, this loader's is 12"):
        StatefulDataLoader(list(range(12)), 2).load_state_dict(state)


def test_uses_getitems_and_collate():
    class Data:
        calls = []

        def __len__(self):
            return 6

        def __getitems__(self, idx):
            self.calls.append(list(idx))
            return [i * 10 for i in idx]

    data = Data()
    batches = list(StatefulDataLoader(data, 3, collate_fn=sum, shuffle=False))
    assert batches == [30, 120] and data.calls == [[0, 1, 2], [3, 4, 5]]
