"""The cheapest assignment the search finds (`planner/search.py`)."""

from keras_autoshard.planner.cost_model import MeshAxis, PlannerOptions
from keras_autoshard.planner.search import search
from tests.graph.jaxpr.small_graphs import graph_of
from tests.planner.small_models import (
    AXES,
    batch_class,
    blocks_graph,
    param_class,
)


def _hidden(graph):
    return {param_class(graph, f"{b}/up/kernel", 1) for b in ("block", "block_1")}


def test_on_2x4_the_batch_goes_on_batch_and_the_mlp_features_on_model():
    graph = blocks_graph()
    found = search(graph, AXES, PlannerOptions())
    assert dict(found.class_axis) == {
        batch_class(graph): "batch",
        **dict.fromkeys(_hidden(graph), "model"),
    }
    assert dict(found.fsdp) == {}
    assert found.search.status == "optimal"


def test_a_data_axis_cuts_only_the_batch():
    graph = blocks_graph()
    found = search(graph, (MeshAxis.named("batch", 4),), PlannerOptions())
    assert dict(found.class_axis) == {batch_class(graph): "batch"}


def test_a_lone_model_axis_takes_the_batch_when_it_can_cut_nothing_else():
    """6 features in and out do not divide over 4 devices: Megatron would repeat
    the product on every device, a cut batch does not."""
    graph = graph_of(lambda w, x: x @ w, ("param", "w", (6, 6)), ("input", "x", (8, 6)))
    (x,) = [t for t in graph.tensors if t.kind == "input"]
    axes = (MeshAxis.named("model", 4),)
    assert dict(search(graph, axes, PlannerOptions()).class_axis) == {
        x.dim_classes[0]: "model"
    }
    kept = search(graph, axes, PlannerOptions(batch_over_model_axes=False))
    assert dict(kept.class_axis) == {}
