import itertools

import numpy as np
import pytest

from rl_distributed.named_sharding import NamedSharding


@pytest.fixture
def grid() -> NamedSharding:
    # pp x dp x tp = 2 x 3 x 2, ranks numbered tp-fastest as in a typical launch.
    return NamedSharding(np.arange(12).reshape(2, 3, 2), ["pp", "dp", "tp"])


def test_describes_its_grid(grid):
    assert grid.shape == {"pp": 2, "dp": 3, "tp": 2}
    assert list(grid.shape) == ["pp", "dp", "tp"]  # axis order is kept
    assert grid.names == ["pp", "dp", "tp"]
    assert (grid.ndim, grid.size) == (3, 12)
    assert grid.get_axis_size("dp") == 3
    np.testing.assert_array_equal(grid.layout, np.arange(12).reshape(2, 3, 2))


def test_nested_list_and_array_layouts_are_the_same_sharding():
    a = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    b = NamedSharding(np.array([[0, 1], [2, 3]], dtype=np.int32), ["dp", "tp"])
    assert a == b and hash(a) == hash(b)
    assert a != NamedSharding([[0, 2], [1, 3]], ["dp", "tp"])
    assert a != NamedSharding([[0, 1], [2, 3]], ["tp", "dp"])
    assert repr(a) == "NamedSharding(layout=[[0, 1], [2, 3]], names=['dp', 'tp'])"


def test_worker_coords_point_back_at_the_rank(grid):
    layout = np.arange(12).reshape(2, 3, 2)
    for rank in range(12):
        coords = grid.get_worker_coords(rank)
        assert list(coords) == ["pp", "dp", "tp"]
        assert layout[coords["pp"], coords["dp"], coords["tp"]] == rank
    assert NamedSharding([[3, 0], [2, 1]], ["dp", "tp"]).get_worker_coords(1) == {"dp": 1, "tp": 1}


def test_fixing_every_axis_gives_the_rank(grid):
    for pp, dp, tp in itertools.product(range(2), range(3), range(2)):
        assert grid.get_ranks(pp=pp, dp=dp, tp=tp) == pp * 6 + dp * 2 + tp


def test_fixing_some_axes_gives_a_sub_sharding_with_original_ranks(grid):
    tp_group = grid.get_ranks(pp=1, dp=2)
    assert isinstance(tp_group, NamedSharding)
    assert tp_group.names == ["tp"]
    assert tp_group.layout.tolist() == [10, 11]
    assert tp_group.get_worker_coords(11) == {"tp": 1}

    stage = grid.get_ranks(pp=1)
    assert stage.shape == {"dp": 3, "tp": 2}
    assert stage.layout.tolist() == [[6, 7], [8, 9], [10, 11]]
    # Sub-shardings compose: fixing dp then tp in two steps reaches the same rank.
    assert stage.get_ranks(dp=1).get_ranks(tp=0) == grid.get_ranks(pp=1, dp=1, tp=0) == 8
    assert grid.get_ranks() == grid


def test_layout_cannot_be_mutated_through_the_property(grid):
    with pytest.raises(ValueError, match="read-only"):
        grid.layout[0, 0, 0] = 5


@pytest.mark.parametrize(
    ("layout", "names", "message"),
    [
        ([[0, 1.5], [2, 3]], ["dp", "tp"], "ranks must be integers.*1.5"),
        ([[0.0, 1.0]], ["dp", "tp"], "ranks must be integers"),
        ([["0", "1"]], ["dp", "tp"], "ranks must be integers"),
        ([[True, False]], ["dp", "tp"], "ranks must be integers"),
        ([[0, None]], ["dp", "tp"], "ranks must be integers, got None"),
        ([[0, 1], [1, 2]], ["dp", "tp"], r"duplicate ranks \[1\].*missing ranks \[3\]"),
        ([[0, 1], [2, 4]], ["dp", "tp"], r"missing ranks \[3\].*out of range \[4\]"),
        ([[1, 2]], ["dp", "tp"], r"missing ranks \[0\]"),
        ([[0, 1], [2, 3]], ["dp"], "layout has 2 axes but 1 names"),
        ([[0, 1], [2, 3]], ["dp", "dp"], "axis names must be unique"),
        ([[0, 1], [2, 3]], ["dp", 3], "axis names must be strings"),
        ([], ["dp"], "layout is empty"),
        ([[]], ["dp", "tp"], "layout is empty"),
        (0, [], "at least one axis"),
        ([[0, 1], [2]], ["dp", "tp"], "rectangular"),
    ],
)
def test_invalid_layouts_are_rejected_with_the_reason(layout, names, message):
    with pytest.raises(ValueError, match=message):
        NamedSharding(layout, names)


def test_unknown_axis_names_the_valid_axes(grid):
    with pytest.raises(ValueError, match=r"unknown axis 'cp'.*\['pp', 'dp', 'tp'\]"):
        grid.get_ranks(cp=0)
    with pytest.raises(ValueError, match="unknown axis 'cp'"):
        grid.get_axis_size("cp")


@pytest.mark.parametrize(
    ("coord", "message"), [(3, "out of range"), (-1, "out of range"), (1.0, "integer")]
)
def test_bad_coordinates_are_rejected(grid, coord, message):
    with pytest.raises(ValueError, match=f"dp={coord}.*{message}"):
        grid.get_ranks(dp=coord)


@pytest.mark.parametrize("rank", [12, -1, 1.0, True, "1"])
def test_unknown_rank_is_rejected(grid, rank):
    with pytest.raises(ValueError, match="is not in NamedSharding"):
        grid.get_worker_coords(rank)
