"""The MILP builder (`milp_builder`) on a hand-built graph of one matrix
product: the class variables it adds, and the sharding read off the
solution."""

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
