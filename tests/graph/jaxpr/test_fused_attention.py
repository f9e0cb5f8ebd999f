"""The rules of cuDNN's fused attention (`graph/jaxpr/fused_attention.py`)
on tiny jaxprs, traced on a CPU by answering JAX's cuDNN version probe as a
GPU machine does (as `tests/planner/test_fused_attention_end_to_end.py` does)."""

import jax

from keras_autoshard.graph.jaxpr import fused_attention
from tests.graph.jaxpr.small_graphs import (
    class_of,
    family_primitives,
    graph_of,
    named,
    output,
)
from tests.planner.test_fused_attention_end_to_end import cudnn_found

KERNEL = "contracted inside cuDNN's fused attention"


def test_the_family_rules_the_forward_and_backward_kernels():
    assert family_primitives(fused_attention) == {
        *fused_attention.FORWARD_PRIMITIVES,
        *fused_attention.BACKWARD_PRIMITIVES,
    }


def _attention_graph(kv_heads, causal):
    def f(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"
        )

    with cudnn_found():
        return graph_of(
            f,
            ("input", "q", (2, 16, 4, 8), "bfloat16"),
            ("input", "k", (2, 16, kv_heads, 8), "bfloat16"),
            ("input", "v", (2, 16, kv_heads, 8), "bfloat16"),
        )


def test_batch_heads_and_query_sequence_go_with_the_output():
    graph = _attention_graph(kv_heads=4, causal=False)
    q, k, v = (named(graph, name) for name in "qkv")
    out = output(graph)
    assert (
        q.dim_classes[0] == k.dim_classes[0] == v.dim_classes[0] == out.dim_classes[0]
    )
    assert (
        q.dim_classes[2] == k.dim_classes[2] == v.dim_classes[2] == out.dim_classes[2]
    )
    assert q.dim_classes[1] == out.dim_classes[1]
    assert class_of(graph, q, 1).shardable
    assert class_of(graph, k, 1).unshardable_reason == KERNEL
    assert class_of(graph, q, 3).unshardable_reason == KERNEL
    forward = [e for e in graph.comm_events if e.phase == "forward"]
    assert [(e.primitive, e.classes) for e in forward] == [
        ("dot_product_attention_fwd_wrapper", (k.dim_classes[1],))
    ] * 2


def test_grouped_heads_are_cut_together_and_a_causal_mask_keeps_the_queries_whole():
    graph = _attention_graph(kv_heads=2, causal=True)
    q, k = named(graph, "q"), named(graph, "k")
    assert q.dim_classes[2] != k.dim_classes[2]
    grouped = {(e.source, e.target) for e in graph.slice_edges}
    assert (k.dim_classes[2], q.dim_classes[2]) in grouped
    assert (q.dim_classes[2], k.dim_classes[2]) in grouped
    reason = "query sequence of a causal or windowed fused attention"
    assert class_of(graph, q, 1).unshardable_reason == reason


def test_the_backward_kernels_gradients_are_laid_out_as_their_operands():
    def query_gradient(q, k, v):
        def loss(q):
            attended = jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
            return attended.astype("float32").sum()

        return jax.grad(loss)(q)

    args = [("input", name, (2, 16, 4, 8), "bfloat16") for name in "qkv"]
    with cudnn_found():
        graph = graph_of(query_gradient, *args)
        structs = [jax.ShapeDtypeStruct(arg[2], arg[3]) for arg in args]
        traced = str(jax.make_jaxpr(query_gradient)(*structs))
    assert fused_attention.BACKWARD_PRIMITIVES[0] in traced
    assert graph.unknown_primitives == ()
    assert output(graph).dim_classes == named(graph, "q").dim_classes
