"""The rule of primitives batched over leading dims (`graph/jaxpr/batched.py`)
on tiny jaxprs."""

import jax.numpy as jnp

from keras_autoshard.graph.jaxpr import batched
from tests.graph.jaxpr.small_graphs import (
    class_of,
    family_primitives,
    graph_of,
    named,
    output,
)


def test_the_family_rules_ffts_and_batched_linear_algebra():
    assert family_primitives(batched) == {
        "fft", "cholesky", "triangular_solve", "lu", "qr", "householder_product",
        "eigh", "svd",
    }  # fmt: skip


def test_an_fft_unifies_its_leading_dims_and_keeps_its_core_dim_whole():
    graph = graph_of(lambda x: jnp.fft.fft(x), ("input", "x", (4, 6, 8), "complex64"))
    x, out = named(graph, "x"), output(graph)
    assert out.dim_classes[:2] == x.dim_classes[:2]
    assert class_of(graph, x, 0).shardable and class_of(graph, x, 1).shardable
    assert class_of(graph, x, 2).unshardable_reason == "core dim of fft"
    assert class_of(graph, out, 2).unshardable_reason == "core dim of fft"


def test_a_batched_qr_keeps_both_matrix_dims_whole():
    graph = graph_of(lambda x: jnp.linalg.qr(x)[0], ("input", "x", (4, 8, 8)))
    x, q = named(graph, "x"), output(graph)
    assert q.dim_classes[0] == x.dim_classes[0]
    assert class_of(graph, x, 0).shardable
    for dim in (1, 2):
        assert class_of(graph, x, dim).unshardable_reason == "core dim of qr"
