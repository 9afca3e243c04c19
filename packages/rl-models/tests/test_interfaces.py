"""Loss inputs form a closed set; metric reductions are declared, never mixed."""

import pytest

from rl_models.interfaces import (
    LossInput,
    LossTokenLogprobs,
    Max,
    Min,
    combine_metric,
    loss_input_type,
)


def test_an_old_string_input_type_names_its_class():
    class OldStyle:
        input_type = "loss_token_logprobs"

    with pytest.raises(ValueError, match="now the class LossTokenLogprobs"):
        loss_input_type(OldStyle())


def test_a_loss_input_no_backend_provides_is_refused_at_declaration():
    class HiddenStates(LossInput):
        pass

    class Mine:
        input_type = HiddenStates

    with pytest.raises(ValueError, match=r"Mine\.input_type is .*HiddenStates"):
        loss_input_type(Mine)  # the class itself, as config validation passes it
    assert loss_input_type(type("L", (), {"input_type": LossTokenLogprobs})) is LossTokenLogprobs


def test_metric_values_combine_by_their_declared_reduction_in_any_order():
    assert combine_metric([Min(0.5), Min(0.2)], sum) == 0.2
    assert isinstance(combine_metric([Min(0.5), Min(0.2)], sum), Min)
    assert combine_metric([Max(0.5), Max(0.2)], sum) == 0.5
    assert combine_metric([1.0, 2.0], sum) == 3.0
    for mixed in ([1.0, Min(0.5)], [Min(0.5), 1.0], [Max(1.0), Min(0.5)]):
        with pytest.raises(ValueError, match=r"'ratio'.*one reduction per metric"):
            combine_metric(mixed, sum, "ratio")
