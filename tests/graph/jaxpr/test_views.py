"""The rules of primitives that move, regroup or select dims
(`graph/jaxpr/views.py`) on tiny jaxprs."""

import jax.numpy as jnp
from jax import lax

from keras_autoshard.graph.jaxpr import views
from tests.graph.jaxpr.small_graphs import (
    class_of,
    family_primitives,
    graph_of,
    named,
    output,
)

X = ("input", "x", (8, 16))


def test_the_family_rules_views_slices_and_joins():
    assert {
        "broadcast_in_dim", "reshape", "transpose", "squeeze", "rev", "slice",
        "dynamic_slice", "dynamic_update_slice", "pad", "concatenate", "tile",
        "split", "stack", "unstack",
    } == family_primitives(views)  # fmt: skip


def _edges(graph):
    return {(e.source, e.target, e.reason) for e in graph.slice_edges}


def test_a_broadcast_weight_maps_its_dim_and_has_its_gradient_reduced_over_the_new():
    graph = graph_of(
        lambda b: lax.broadcast_in_dim(b, (8, 16), (1,)), ("param", "b", (16,))
    )
    b, out = named(graph, "b"), output(graph)
    assert out.dim_classes[1] == b.dim_classes[0]
    (event,) = graph.comm_events
    assert (event.kind, event.phase, event.tensor) == (
        "broadcast_grad",
        "backward",
        b.id,
    )
    assert event.classes == (out.dim_classes[0],)


def test_a_reshape_split_links_the_major_factor_and_keeps_the_minor_whole():
    graph = graph_of(lambda x: x.reshape(8, 4, 4), X)
    x, out = named(graph, "x"), output(graph)
    assert out.dim_classes[0] == x.dim_classes[0]
    assert _edges(graph) == {(x.dim_classes[1], out.dim_classes[1], "reshape split")}
    assert class_of(graph, out, 2).unshardable_reason == "minor factor of reshape split"
    assert class_of(graph, out, 1).shardable and class_of(graph, x, 1).shardable


def test_a_reshape_merge_links_the_major_factor_and_keeps_the_minor_whole():
    graph = graph_of(lambda x: x.reshape(8, 16), ("input", "x", (8, 4, 4)))
    x, out = named(graph, "x"), output(graph)
    assert _edges(graph) == {(x.dim_classes[1], out.dim_classes[1], "reshape merge")}
    assert class_of(graph, x, 2).unshardable_reason == "minor factor of reshape merge"


def test_a_transpose_swaps_the_classes():
    graph = graph_of(lambda x: x.T, X)
    x, out = named(graph, "x"), output(graph)
    assert out.dim_classes == (x.dim_classes[1], x.dim_classes[0])


def test_a_slice_and_a_pad_keep_the_dim_they_cut_whole_behind_an_edge():
    for f, reason in (
        (lambda x: x[:, :8], "sliced dim of slice"),
        (lambda x: jnp.pad(x, ((0, 0), (1, 1))), "padded dim of pad"),
    ):
        graph = graph_of(f, X)
        x, out = named(graph, "x"), output(graph)
        assert out.dim_classes[0] == x.dim_classes[0]
        assert class_of(graph, x, 1).unshardable_reason == reason
        assert _edges(graph) == {(x.dim_classes[1], out.dim_classes[1], reason)}


def test_equal_parts_joined_on_the_leading_dim_stay_cuttable():
    graph = graph_of(
        lambda a, b: jnp.concatenate([a, b], axis=0), X, ("input", "y", (8, 16))
    )
    x, y, out = named(graph, "x"), named(graph, "y"), output(graph)
    assert x.dim_classes[1] == y.dim_classes[1] == out.dim_classes[1]
    assert class_of(graph, x, 0).shardable and class_of(graph, out, 0).shardable
    assert all(edge.joined for edge in graph.slice_edges)
    assert {(e.source, e.target) for e in graph.slice_edges} == {
        (x.dim_classes[0], out.dim_classes[0]),
        (y.dim_classes[0], out.dim_classes[0]),
    }


def test_parts_joined_along_features_keep_the_joined_dim_whole():
    graph = graph_of(
        lambda a, b: jnp.concatenate([a, b], axis=1), X, ("input", "y", (8, 4))
    )
    x, out = named(graph, "x"), output(graph)
    reason = "concatenated dim of concatenate"
    assert class_of(graph, x, 1).unshardable_reason == reason
    assert class_of(graph, out, 0).shardable


def test_an_update_slice_keeps_the_updated_dim_whole():
    graph = graph_of(
        lambda x, u: lax.dynamic_update_slice(x, u, (0, 0)), X, ("input", "u", (8, 4))
    )
    x, u, out = named(graph, "x"), named(graph, "u"), output(graph)
    assert out.dim_classes == x.dim_classes
    assert u.dim_classes[0] == x.dim_classes[0]
    reason = "updated dim of dynamic_update_slice"
    assert class_of(graph, out, 1).unshardable_reason == reason
    assert class_of(graph, u, 1).unshardable_reason == reason
