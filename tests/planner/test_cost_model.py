"""The cost of a candidate sharding (`planner/cost_model.py`), through
`evaluate`."""

from keras_autoshard.planner.cost_model import Assignment, PlannerOptions, evaluate
from tests.planner.small_models import AXES, batch_class, blocks_graph, param_class

PARAMETER_BYTES = 4 * (50 * 16 + 2 * (16 * 64 + 64 + 64 * 16 + 16))


def test_uncut_every_device_holds_everything_moves_nothing_and_repeats_the_math():
    cost = evaluate(blocks_graph(), AXES, Assignment(class_axis={}), PlannerOptions())
    assert cost.parameter_bytes == cost.gradient_bytes == PARAMETER_BYTES
    assert cost.optimizer_bytes == 2 * PARAMETER_BYTES
    assert cost.communication_bytes == 0
    assert cost.replicated_flops > 0


def test_megatron_blocks_over_model_and_the_batch_over_batch():
    graph = blocks_graph()
    hidden = {param_class(graph, f"{b}/up/kernel", 1) for b in ("block", "block_1")}
    megatron = Assignment(
        class_axis={batch_class(graph): "batch", **dict.fromkeys(hidden, "model")}
    )
    cost = evaluate(graph, AXES, megatron, PlannerOptions())
    # The table (800 floats) and the down biases (16 each) stay whole; the
    # rest of each block is cut 4 ways.
    held = 4 * (50 * 16 + 2 * (16 * 64 + 64 + 64 * 16) // 4 + 2 * 16)
    assert cost.parameter_bytes == held
    assert cost.replicated_flops == 0
    # batch: every gradient as held; model: per block, the down output's
    # partial sums forward and the up input's gradient backward, each
    # (2 of 4 rows) x 8 tokens x 16 floats.
    assert cost.communication_by_axis == {
        "batch": held,
        "model": 2 * 2 * 2 * 8 * 16 * 4,
    }
