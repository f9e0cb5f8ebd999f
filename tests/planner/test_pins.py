"""`pins`: user rules matched to variables once, checked on each mesh, and
turned into the search's `Pins`; every error names the rule and the fix."""

import re

import pytest

from keras_autoshard.errors import PlanError
from keras_autoshard.planner.pins import (
    Pins,
    RuleMatch,
    match_variables,
    pinned_specs,
    pins_on_mesh,
)
from keras_autoshard.plans.mesh import MeshSpec
from keras_autoshard.trace.tracer import VariableInfo
from tests.planner.tiny_graph import MESH, dense_graph

VARIABLES = (VariableInfo("w", (16, 32), "float32", True),)


def pins(rules, mesh=MESH) -> Pins:
    return pins_on_mesh(dense_graph(), match_variables(VARIABLES, rules), mesh)


def test_no_rules_pin_nothing():
    assert match_variables(VARIABLES, None) == {}
    assert pins(None) == Pins(no_fsdp=frozenset())


def test_a_rule_pins_its_classes_and_the_variables_storage():
    matches = match_variables(VARIABLES, {"w": (None, "model")})
    assert matches == {"w": RuleMatch("w", (None, "model"), (16, 32))}
    assert pinned_specs(matches) == {"w": (None, "model")}
    assert pins({"w": (None, "model")}) == Pins(
        class_axis={1: None, 2: "model"}, fsdp={}, no_fsdp=frozenset({"w"})
    )


def test_a_spec_of_the_wrong_length_is_an_error_before_any_mesh():
    message = (
        "Rule 'w' (spec ('model',)) on variable 'w' (16, 32): the spec has 1 "
        "entries, the variable 2 dims. Give one mesh axis or None per dim."
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        match_variables(VARIABLES, {"w": ("model",)})


def test_a_rule_that_matches_nothing_is_an_error():
    with pytest.raises(
        PlanError, match=re.escape("Rule(s) ['v'] match no variable of the model")
    ):
        match_variables(VARIABLES, {"v": (None, "model")})


def test_a_mesh_axis_not_in_the_mesh_is_named():
    with pytest.raises(
        PlanError, match=re.escape("mesh axis 'tensor' is not in the mesh")
    ):
        pins({"w": (None, "tensor")})


def test_a_mesh_axis_on_two_dims_is_an_error():
    with pytest.raises(PlanError, match="a mesh axis may cut only one dim of a tensor"):
        pins({"w": ("model", "model")})


def test_an_axis_that_does_not_divide_its_dim_names_the_size_and_the_fix():
    message = (
        "Rule 'w' (spec (None, 'model')) on variable 'w' (16, 32): dim 1 has "
        "size 32, which mesh axis 'model' (size 3) does not divide. Cut another "
        "dim, use a mesh axis that divides it, or pad the layer to a multiple "
        "of 3."
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        pins({"w": (None, "model")}, MeshSpec((2, 3), ("batch", "model")))


def test_a_dim_over_several_mesh_axes_is_left_to_plan_from_rules():
    with pytest.raises(PlanError, match="cuts dim 1 over several mesh axes"):
        pins({"w": (None, ("batch", "model"))})


def test_a_data_axis_on_a_model_class_is_pinned_for_the_search_to_refuse():
    # The search, not the pins, says the class cannot take a data axis.
    assert pins({"w": ("batch", None)}).class_axis == {1: "batch", 2: None}
