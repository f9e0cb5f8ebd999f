"""Which classes carry the batch and which a plan may cut
(`planner/batch_classes.py`)."""

from keras_autoshard.planner.batch_classes import (
    batch_carrying_classes,
    eligible_classes,
    input_batch_classes,
)
from tests.graph.jaxpr.small_graphs import graph_of
from tests.planner.small_models import batch_class, blocks_graph, param_class


def test_the_batch_is_the_inputs_leading_class_and_a_sequence_is_not_offered():
    graph = blocks_graph()
    batch = batch_class(graph)
    assert input_batch_classes(graph) == batch_carrying_classes(graph) == {batch}
    (tokens,) = [t for t in graph.tensors if t.kind == "input"]
    parameter_classes = {c for t in graph.params() for c in t.dim_classes}
    # The token positions belong to no parameter: nothing lays them out.
    assert eligible_classes(graph) == parameter_classes | {batch}
    assert tokens.dim_classes[1] not in eligible_classes(graph)
    assert param_class(graph, "block/up/kernel", 1) in eligible_classes(graph)


def test_tokens_flattened_out_of_the_batch_carry_it():
    """`(b, s, d) -> (b·s, d)`: the merged rows carry the batch (a router
    reads them so), and a data axis may cut them."""
    graph = graph_of(
        lambda w, x: x.reshape(32, 16) @ w,
        ("param", "w", (16, 4)),
        ("input", "x", (4, 8, 16)),
    )
    (x,) = [t for t in graph.tensors if t.kind == "input"]
    out = graph.tensors[graph.outputs[0]]
    assert input_batch_classes(graph) == {x.dim_classes[0]}
    assert batch_carrying_classes(graph) == {x.dim_classes[0], out.dim_classes[0]}
    assert out.dim_classes[0] in eligible_classes(graph)
