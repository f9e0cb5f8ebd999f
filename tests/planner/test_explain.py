"""Why the plan decided as it did, in words (`planner/explain.py`)."""

from keras_autoshard.planner.cost_model import Assignment
from keras_autoshard.planner.explain import batch_notes
from keras_autoshard.plans.sharding_plan import MeshSpec
from tests.graph.jaxpr.small_graphs import graph_of


def _graph(rows):
    return graph_of(
        lambda w, x: x @ w, ("param", "w", (16, 16)), ("input", "x", (rows, 16))
    )


def test_a_batch_that_does_not_divide_the_data_axis_is_said_to_stay_whole():
    notes = batch_notes(_graph(3), MeshSpec((2,), ("batch",)), Assignment({}))
    assert notes == [
        "The batch of input 'x' (3 rows) is not split over 'batch' (size 2): "
        "every device of that axis computes the whole batch. Why: 3 rows do "
        "not divide 'batch' (size 2); use a batch size that is a multiple of 2."
    ]


def test_a_batch_split_over_the_data_axis_needs_no_note():
    graph = _graph(4)
    (x,) = [t for t in graph.tensors if t.kind == "input"]
    split = Assignment({x.dim_classes[0]: "batch"})
    assert batch_notes(graph, MeshSpec((2,), ("batch",)), split) == []
