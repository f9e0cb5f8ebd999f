"""`MilpProgram` on a hand-built graph of one matrix product: the
one-hot patterns, the bytes terms, the rows tying variables."""

import numpy as np

from keras_autoshard.planner.milp_program import MilpProgram
from keras_autoshard.planner.pins import Pins
from tests.planner.test_milp_builder import program_with_classes
from tests.planner.tiny_graph import axes, dense_graph, options


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
