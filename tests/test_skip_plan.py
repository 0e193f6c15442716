import pytest
from hypothesis import given
from hypothesis import strategies as st

from s3djax.errors import UserError
from s3djax.skip_plan import SkipPlan


def test_parse_whole_layers_and_sub_layers():
    plan = SkipPlan.parse("1-2,4.attn,5.mlp", 6)
    assert plan.attn == (True, False, False, True, False, True)
    assert plan.mlp == (True, False, False, True, True, False)
    assert SkipPlan.parse(plan.spec(), 6) == plan


def test_symmetric_middle_matches_the_s3d_default_for_smollm2():
    plan = SkipPlan.symmetric_middle(30, 14)
    assert plan == SkipPlan.parse("8-21", 30)
    assert sum(plan.attn) == 16


@pytest.mark.parametrize("spec, message", [
    ("0-5", "nothing is left to run"),
    ("3-9", "outside 0-5"),
    ("a-b", "not a layer number"),
    ("2.ffn", "must end in .attn or .mlp"),
    ("0-5.attn,0-5.mlp", "nothing is left to run"),
])
def test_invalid_specs_are_user_errors(spec, message):
    with pytest.raises(UserError, match=message):
        SkipPlan.parse(spec, 6)


def test_wrong_length_is_rejected_by_the_model():
    with pytest.raises(UserError, match="has 4 layers but the model has 6"):
        SkipPlan.full(4).check(6)


@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=40).filter(
    lambda flags: any(a or m for a, m in flags)))
def test_any_runnable_plan_round_trips_through_its_spec(flags):
    plan = SkipPlan(tuple(a for a, _ in flags), tuple(m for _, m in flags))
    assert SkipPlan.parse(plan.spec(), len(flags)) == plan
