"""`MilpProgram` and its builder (`milp_builder`) on a hand-built graph of
one matrix product: the one-hot patterns, the bytes terms, the rows tying
variables, and the sharding read off the solution."""

import numpy as np
import pytest

from keras_autoshard.planner.milp_builder import add_class_vars, solve_program
from keras_autoshard.planner.milp_program import MilpProgram
from keras_autoshard.planner.pins import Pins
from tests.planner.tiny_graph import axes, dense_graph, options


def program_with_classes(pins: Pins | None = None) -> MilpProgram:
    program = MilpProgram(dense_graph(), axes(), options(), pins or Pins())
    add_class_vars(program)
    return program


def test_class_variables_keep_model_classes_off_data_axes():
    program = program_with_classes()
    # The batch (class 0) may go on the data axis or the axis spanning the
    # mesh; the weight's classes only on the model axis.
    assert set(program.x) == {
        (0, "batch"),
        (0, "batch+model"),
        (1, "model"),
        (2, "model"),
    }


def test_pattern_is_one_hot_over_the_subsets_of_axes_that_cut_a_tensor():
    program = program_with_classes()
    weight = program.graph.param("w")
    pattern = program.pattern(weight, fsdp=False)
    assert set(pattern) == {frozenset(), frozenset({"model"})}
    # Asked again, the same variables (one pattern per class set).
    assert program.pattern(weight, fsdp=False) is pattern
    fixed, terms = program.bytes_terms(weight, fsdp=False, scale=2.0)
    assert fixed == 0.0
    assert terms == {
        pattern[frozenset()]: 2.0 * weight.nbytes,
        pattern[frozenset({"model"})]: 2.0 * weight.nbytes / 4,
    }


def test_a_tensor_no_variable_cuts_has_constant_bytes():
    program = MilpProgram(dense_graph(), axes(), options(), Pins())
    weight = program.graph.param("w")
    assert program.pattern(weight, fsdp=False) is None
    assert program.bytes_terms(weight, fsdp=False, scale=3.0) == (
        3.0 * weight.nbytes,
        {},
    )


def test_add_equal_ties_two_variables_and_fixes_one_alone_at_zero():
    program = MilpProgram(dense_graph(), axes(), options(), Pins())
    a, b = program.lp.add_var(integer=True), program.lp.add_var(integer=True)
    program.add_equal(None, None)
    assert program.lp.rows == []
    program.add_equal(a, None)
    program.add_equal(a, b)
    assert program.lp.rows == [{a: 1.0}, {a: 1.0, b: -1.0}]
    assert program.lp.row_upper == [0.0, 0.0]
    assert program.lp.row_lower == [-np.inf, 0.0]


def test_cuts_over_counts_a_spanning_axis_as_a_cut_of_its_members():
    program = program_with_classes()
    x = program.x
    assert program.cuts_over({0}, "batch") == {
        x[(0, "batch")]: 1.0,
        x[(0, "batch+model")]: 1.0,
    }
    assert program.cuts_over({0, 2}, "model") == {
        x[(0, "batch+model")]: 1.0,
        x[(2, "model")]: 1.0,
    }


def test_the_cheapest_sharding_of_a_matrix_product_cuts_batch_and_outputs():
    assignment = solve_program(dense_graph(), axes(), options(), Pins(), "forced")
    # Cutting the output features moves nothing forward; cutting the
    # contracted ones would all-reduce `y`.
    assert assignment.class_axis == {0: "batch", 2: "model"}
    assert assignment.fsdp == {}
    assert assignment.search.status == "optimal"


def test_a_class_pinned_whole_stays_whole():
    pins = Pins(class_axis={2: None})
    assignment = solve_program(dense_graph(), axes(), options(), pins, "forced")
    assert 2 not in assignment.class_axis
    assert assignment.class_axis[0] == "batch"


def test_a_pin_the_class_cannot_take_is_infeasible():
    from keras_autoshard.planner.linear_program import InfeasibleError

    with pytest.raises(InfeasibleError, match="axis class 2 on 'batch'"):
        program_with_classes(Pins(class_axis={2: "batch"}))
