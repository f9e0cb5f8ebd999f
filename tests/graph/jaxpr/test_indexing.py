"""The gather and scatter rules (`graph/jaxpr/indexing.py`) on tiny jaxprs."""

import jax.numpy as jnp

from keras_autoshard.graph.jaxpr import indexing
from tests.graph.jaxpr.small_graphs import (
    class_of,
    family_primitives,
    graph_of,
    named,
    output,
)

TABLE = ("param", "table", (100, 16))
IDS = ("input", "ids", (8,), "int32")


def test_the_family_rules_gather_and_scatters():
    assert family_primitives(indexing) == {
        "gather", "scatter", "scatter-add", "scatter_add", "scatter-sub",
        "scatter-mul", "scatter-min", "scatter-max",
    }  # fmt: skip


def test_an_embedding_lookup_gathers_over_the_table_rows():
    graph = graph_of(lambda table, ids: jnp.take(table, ids, axis=0), TABLE, IDS)
    table, ids, out = named(graph, "table"), named(graph, "ids"), output(graph)
    assert out.dim_classes == (ids.dim_classes[0], table.dim_classes[1])
    assert class_of(graph, table, 0).shardable
    events = {(e.kind, e.phase, e.classes, e.tensor) for e in graph.comm_events}
    # Rows cut: each device looks up its rows, zeros elsewhere, all-reduce.
    # Tokens cut: each device's table gradient holds its tokens' rows.
    assert ("gather", "forward", (table.dim_classes[0],), out.id) in events
    assert ("contract", "backward", (ids.dim_classes[0],), table.id) in events


def test_a_scatter_add_reduces_over_the_scattered_updates():
    graph = graph_of(
        lambda u, ids: jnp.zeros((100, 16)).at[ids].add(u),
        ("param", "u", (8, 16)),
        IDS,
    )
    u, ids, out = named(graph, "u"), named(graph, "ids"), output(graph)
    assert u.dim_classes == (ids.dim_classes[0], out.dim_classes[1])
    events = {(e.kind, e.phase, e.classes, e.tensor) for e in graph.comm_events}
    assert ("reduce", "forward", (ids.dim_classes[0],), out.id) in events
    assert ("gather", "backward", (out.dim_classes[0],), u.id) in events


def test_a_scatter_that_overwrites_keeps_the_scattered_dims_whole():
    graph = graph_of(
        lambda u, ids: jnp.zeros((100, 16)).at[ids].set(u),
        ("param", "u", (8, 16)),
        IDS,
    )
    u, out = named(graph, "u"), output(graph)
    assert class_of(graph, out, 0).unshardable_reason == "scattered dim of scatter"
    assert class_of(graph, u, 0).unshardable_reason == "scattered dim of scatter"
    assert class_of(graph, out, 1).shardable
