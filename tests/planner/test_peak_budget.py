"""`peak_budget.add_peak_budget` on a hand-built graph of one matrix
product: no row without a budget, the storage cut a tight budget forces,
and the error when no sharding can fit."""

import pytest

from keras_autoshard.planner.linear_program import InfeasibleError
from keras_autoshard.planner.milp_builder import (
    add_class_vars,
    add_fsdp_vars,
    solve_program,
)
from keras_autoshard.planner.milp_program import MilpProgram
from keras_autoshard.planner.peak_budget import PEAK_WEIGHT, add_peak_budget
from keras_autoshard.planner.pins import Pins
from tests.planner.tiny_graph import axes, dense_graph, options


def built(**changes) -> MilpProgram:
    program = MilpProgram(dense_graph(), axes(), options(**changes), Pins())
    add_class_vars(program)
    add_fsdp_vars(program)
    return program


def test_without_a_budget_nothing_is_added():
    program = built()
    rows, variables = len(program.lp.rows), program.lp.num_vars
    add_peak_budget(program, frozenset())
    assert (len(program.lp.rows), program.lp.num_vars) == (rows, variables)


def test_minimizing_the_peak_prices_it_above_any_byte_moved():
    program = built(minimize_peak=True)
    variables = program.lp.num_vars
    add_peak_budget(program, frozenset())
    peak_costs = [c for c in program.lp.costs[variables:] if c > 0]
    assert peak_costs and max(peak_costs) >= PEAK_WEIGHT


def test_a_budget_that_holds_the_whole_weight_leaves_its_storage_whole():
    assignment = solve_program(
        dense_graph(), axes(), options(memory_budget_bytes=10**9), Pins(), "forced"
    )
    assert assignment.fsdp == {}


def test_a_tight_budget_cuts_the_weights_storage_over_the_data_axis():
    # 3000 bytes: the weight's state (parameter, gradient, two slots) cut 4
    # ways by the model axis does not fit beside the data; cut 8 ways it does.
    assignment = solve_program(
        dense_graph(), axes(), options(memory_budget_bytes=3000), Pins(), "forced"
    )
    assert assignment.class_axis == {0: "batch", 2: "model"}
    assert assignment.fsdp == {"w": ((0, "batch"),)}


def test_a_budget_below_the_parts_no_sharding_cuts_is_infeasible():
    program = built(memory_budget_bytes=100)
    with pytest.raises(InfeasibleError, match="cannot be cut"):
        add_peak_budget(program, frozenset())


def test_an_accelerators_accumulating_update_cuts_the_weights_storage():
    # On a GPU, 4000 bytes hold the weight's state cut 4 ways by the model
    # axis (512 bytes: parameter, gradient, two slots, the activations).
    # Accumulating, the update after the backward pass also holds the
    # accumulator, the gradient and its reduction's operand, and writes the
    # parameter and its slots anew: 9 copies, 4608 bytes cut 4 ways; cut 8
    # ways over the data axis too, they fit.
    def solved(micro_batches):
        return solve_program(
            dense_graph(),
            axes(),
            options(memory_budget_bytes=4000, platform="gpu"),
            Pins(),
            "forced",
            micro_batches=micro_batches,
        )

    assert solved(1).fsdp == {}
    assert solved(2).fsdp == {"w": ((0, "batch"),)}
