"""The reduction and along-one-axis rules (`graph/jaxpr/reductions.py`) on
tiny jaxprs."""

import jax.numpy as jnp
from jax import lax

from keras_autoshard.graph.jaxpr import reductions
from tests.graph.jaxpr.small_graphs import (
    class_of,
    family_primitives,
    graph_of,
    named,
    output,
)

X = ("input", "x", (8, 16))


def test_the_family_rules_reductions_and_ops_along_one_axis():
    assert {
        "reduce_sum", "reduce_max", "reduce", "argmax", "argmin", "cumsum",
        "sort", "top_k", "reduce_window_max", "reduce_window_sum",
    } <= family_primitives(reductions)  # fmt: skip


def test_a_sum_keeps_the_kept_dims_and_all_reduces_over_the_summed_one():
    graph = graph_of(lambda x: jnp.sum(x, axis=1), X)
    x, out = named(graph, "x"), output(graph)
    assert out.dim_classes == (x.dim_classes[0],)
    assert all(c.shardable for c in graph.classes)
    (event,) = graph.comm_events
    assert (event.kind, event.phase, event.tensor) == ("reduce", "forward", out.id)
    assert event.classes == (x.dim_classes[1],)


def test_argmax_keeps_its_axis_whole():
    graph = graph_of(lambda x: jnp.argmax(x, axis=1), X)
    x, out = named(graph, "x"), output(graph)
    assert out.dim_classes == (x.dim_classes[0],)
    assert class_of(graph, x, 1).unshardable_reason == "reduced dim of argmax"
    assert class_of(graph, x, 0).shardable


def test_a_cumulative_sum_keeps_its_scanned_axis_whole():
    graph = graph_of(lambda x: jnp.cumsum(x, axis=0), X)
    x, out = named(graph, "x"), output(graph)
    assert out.dim_classes == x.dim_classes
    assert class_of(graph, x, 0).unshardable_reason == "scanned dim of cumsum"
    assert class_of(graph, x, 1).shardable


def test_sort_and_top_k_keep_their_axis_whole():
    graph = graph_of(lambda x: jnp.sort(x, axis=-1), X)
    x = named(graph, "x")
    assert output(graph).dim_classes == x.dim_classes
    assert class_of(graph, x, 1).unshardable_reason == "sorted dim of sort"
    graph = graph_of(lambda x: lax.top_k(x, 4), X)
    x, values, indices = named(graph, "x"), output(graph, 0), output(graph, 1)
    assert values.dim_classes[0] == indices.dim_classes[0] == x.dim_classes[0]
    assert class_of(graph, x, 1).unshardable_reason == "top_k dim of top_k"
    assert class_of(graph, values, 1).unshardable_reason == "top_k dim of top_k"


def test_a_pooling_window_keeps_its_windowed_dim_whole_and_others_unified():
    graph = graph_of(
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID"), X
    )
    x, out = named(graph, "x"), output(graph)
    assert out.shape == (8, 8)
    assert out.dim_classes[0] == x.dim_classes[0]
    reason = "window dim of reduce_window_max"
    assert class_of(graph, x, 1).unshardable_reason == reason
    assert class_of(graph, out, 1).unshardable_reason == reason
