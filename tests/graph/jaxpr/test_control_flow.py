"""The call and loop rules (`graph/jaxpr/control_flow.py`) on tiny jaxprs."""

import jax
import jax.numpy as jnp
from jax import lax

from keras_autoshard.graph.jaxpr import control_flow
from tests.graph.jaxpr.small_graphs import (
    class_of,
    family_primitives,
    graph_of,
    named,
    output,
)

W = ("param", "w", (16, 16))
X = ("input", "x", (8, 16))


def test_the_family_rules_calls_and_loops():
    primitives = family_primitives(control_flow)
    assert {"jit", "checkpoint", "custom_jvp_call", "custom_vjp_call"} <= primitives
    assert {"scan", "while", "cond"} <= primitives


def test_a_jitted_or_rematerialized_body_is_walked_in_place():
    for wrap in (jax.jit, jax.checkpoint):
        graph = graph_of(wrap(lambda w, x: x @ w), W, X)
        w, x, out = named(graph, "w"), named(graph, "x"), output(graph)
        assert graph.unknown_primitives == ()
        assert x.dim_classes[1] == w.dim_classes[0]
        assert out.dim_classes == (x.dim_classes[0], w.dim_classes[1])


def test_a_scan_keeps_its_scanned_dim_whole_and_counts_body_events_per_step():
    def f(w, xs):
        def step(carry, x):
            return jnp.tanh(carry @ w + x), None

        return lax.scan(step, jnp.zeros((8, 16)), xs)[0]

    graph = graph_of(f, W, ("input", "xs", (5, 8, 16)))
    xs, out = named(graph, "xs"), output(graph)
    assert class_of(graph, xs, 0).unshardable_reason == "scanned dim of scan"
    assert out.dim_classes == xs.dim_classes[1:]
    forward = [e for e in graph.comm_events if e.phase == "forward"]
    assert [(e.kind, e.multiplicity) for e in forward] == [("contract", 5)]


def test_a_while_loop_unifies_its_carries_and_says_it_counts_once():
    graph = graph_of(
        lambda w, x: lax.while_loop(
            lambda c: c[1] < 3, lambda c: (c[0] @ w, c[1] + 1), (x, 0)
        )[0],
        W,
        X,
    )
    w, x, out = named(graph, "w"), named(graph, "x"), output(graph)
    # The carry goes through `@ w` and back: its features are w's both dims.
    assert out.dim_classes == x.dim_classes
    assert w.dim_classes[0] == w.dim_classes[1] == x.dim_classes[1]
    assert class_of(graph, w, 0).unshardable_reason == f"appears twice in tensor {w.id}"
    assert any(note.startswith("while (trip count unknown)") for note in graph.notes)


def test_each_branch_of_a_cond_is_unified_with_the_result():
    graph = graph_of(
        lambda p, x: lax.cond(p, lambda v: v * 2.0, lambda v: v.T.T, x),
        ("input", "p", (), "bool"),
        X,
    )
    assert output(graph).dim_classes == named(graph, "x").dim_classes
