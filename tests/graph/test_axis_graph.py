"""Axis graphs of traced models: classes, conflicts and communication events."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import keras
import pytest
from jax import lax
from jax.extend.core import Primitive

from keras_autoshard.graph.axis_graph import (
    AxisGraph,
    DimSizeMismatchError,
    TensorNode,
)
from keras_autoshard.graph.builder import build_axis_graph
from keras_autoshard.graph.jaxpr import residuals
from keras_autoshard.graph.union_find import UnionFind
from keras_autoshard.planner.cost_model import kept_widening

BATCH, SEQ = 2, 16


def _structs(values):
    return [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]


def _input_names(inputs) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(inputs)[0]
    return [
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) or "x"
        for path, _ in leaves
    ]


def trace_model(model: keras.Model, inputs) -> AxisGraph:
    """Trace `model`'s forward pass over shapes only and build its axis graph."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def fwd(tv, ntv, x):
        return model.stateless_call(tv, ntv, x)[0]

    closed = jax.make_jaxpr(fwd)(_structs(trainable), _structs(non_trainable), inputs)
    assert not closed.consts, "weights were captured as constants"
    kinds = (
        [("param", v.path) for v in model.trainable_variables]
        + [("state", v.path) for v in model.non_trainable_variables]
        + [("input", name) for name in _input_names(inputs)]
    )
    return build_axis_graph(closed, kinds)


def _token_inputs():
    spec = jax.ShapeDtypeStruct((BATCH, SEQ), "int32")
    return {"token_ids": spec, "padding_mask": spec}


def _input(graph: AxisGraph, name: str) -> TensorNode:
    return next(t for t in graph.tensors if t.kind == "input" and t.name == name)


def _members(graph: AxisGraph, class_id: int, kind: str) -> set[tuple[str, int]]:
    return {
        (graph.tensors[t].name, d)
        for t, d in graph.classes[class_id].dims
        if graph.tensors[t].kind == kind
    }


def _triggered(graph: AxisGraph, sharded: set[int], phase: str):
    return [
        e for e in graph.comm_events if e.phase == phase and sharded & set(e.classes)
    ]


def test_axis_graph_module_does_not_import_jax():
    code = (
        "import sys, keras_autoshard.graph.axis_graph; "
        "assert 'jax' not in sys.modules, 'axis_graph imported jax'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_union_find_refuses_size_mismatch():
    uf = UnionFind()
    a, b, c = uf.add(4), uf.add(4), uf.add(8)
    uf.union(a, b)
    assert uf.same(a, b) and uf.dim_size(b) == 4
    with pytest.raises(DimSizeMismatchError):
        uf.union(b, c)
    assert not uf.same(a, c)
    uf.mark_unshardable(c, "spatial")
    assert uf.reason(c) == "spatial" and uf.reason(a) is None


def test_column_row_mlp():
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="tanh", name="up"),
            keras.layers.Dense(16, name="down"),
        ],
        name="mlp",
    )
    graph = trace_model(model, jax.ShapeDtypeStruct((8, 16), "float32"))
    up_k, up_b, down_k, down_b = graph.params()
    x = _input(graph, "x")
    hidden = up_k.dim_classes[1]
    assert _members(graph, hidden, "param") == {
        ("mlp/up/kernel", 1),
        ("mlp/up/bias", 0),
        ("mlp/down/kernel", 0),
    }
    hidden_acts = [t for t in graph.tensors if t.shape == (8, 64)]
    assert len(hidden_acts) == 3  # matmul output, bias add, tanh
    assert all(t.dim_classes == (x.dim_classes[0], hidden) for t in hidden_acts)
    (contract,) = graph.events_for(hidden, phase="forward")
    assert contract.kind == "contract" and graph.tensors[contract.tensor].shape == (
        8,
        16,
    )
    # The input is not differentiated: no backward all-reduce for the hidden dim.
    assert graph.events_for(hidden, phase="backward") == []
    batch = x.dim_classes[0]
    out = graph.tensors[graph.events_for(hidden)[0].tensor]
    assert out.dim_classes == (batch, down_k.dim_classes[1])
    assert x.dim_classes[1] == up_k.dim_classes[0] != down_k.dim_classes[1]
    assert down_b.dim_classes == (down_k.dim_classes[1],)
    # Data parallelism: one gradient all-reduce per parameter.
    dp = graph.events_for(batch, phase="backward")
    assert sorted(e.tensor for e in dp) == sorted(p.id for p in graph.params())
    assert graph.events_for(batch, phase="forward") == []
    assert frozenset((batch, hidden)) in graph.conflicts()


def test_layer_outputs_are_read_from_the_name_scopes():
    """Each call of a layer has one output tensor: the last one its name scope
    produced; a layer called twice has two."""
    shared = keras.layers.Dense(16, name="shared")
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, name="up")(shared(inputs))
    outputs = shared(keras.layers.Dense(16, name="down")(hidden))
    model = keras.Model(inputs, outputs)
    graph = trace_model(model, jax.ShapeDtypeStruct((8, 16), "float32"))
    (up_output,) = graph.layer_outputs("up")
    assert graph.tensors[up_output].shape == (8, 32)
    up_bias = graph.param("up/bias")
    assert graph.tensors[up_output].dim_classes[1] == up_bias.dim_classes[0]
    first, second = graph.layer_outputs("shared")
    assert first != second
    assert graph.tensors[first].shape == graph.tensors[second].shape == (8, 16)
    (down_output,) = graph.layer_outputs("down")
    # The second call of "shared" consumes "down"'s output, the first does not.
    assert first < down_output < second
    assert graph.layer_outputs("no_such_layer") == ()


@pytest.fixture(scope="module")
def gpt2_graph() -> AxisGraph:
    import keras_hub

    model = keras_hub.models.GPT2Backbone(
        vocabulary_size=1000,
        num_layers=2,
        num_heads=4,
        hidden_dim=256,
        intermediate_dim=1024,
        max_sequence_length=128,
    )
    return trace_model(model, _token_inputs())


def _gpt2_layer(graph: AxisGraph, i: int) -> dict[str, TensorNode]:
    prefix = f"transformer_layer_{i}/"
    return {
        p.name[len(prefix) :]: p for p in graph.params() if p.name.startswith(prefix)
    }


def test_gpt2_classes(gpt2_graph):
    graph = gpt2_graph
    embedding = graph.param("token_embedding/embeddings")
    hidden = embedding.dim_classes[1]
    heads_classes, mlp_classes = [], []
    for i in range(2):
        layer = _gpt2_layer(graph, i)
        attn = "self_attention/"
        heads = layer[attn + "query/kernel"].dim_classes[1]
        for name in ("query", "key", "value"):
            assert layer[f"{attn}{name}/kernel"].dim_classes[:2] == (hidden, heads)
            assert layer[f"{attn}{name}/bias"].dim_classes[0] == heads
        assert layer[attn + "attention_output/kernel"].dim_classes[0] == heads
        assert layer[attn + "attention_output/kernel"].dim_classes[2] == hidden
        mlp = layer["feedforward_intermediate_dense/kernel"].dim_classes[1]
        assert layer["feedforward_intermediate_dense/bias"].dim_classes == (mlp,)
        assert layer["feedforward_output_dense/kernel"].dim_classes == (mlp, hidden)
        assert graph.classes[heads].size == 4 and graph.classes[mlp].size == 1024
        heads_classes.append(heads)
        mlp_classes.append(mlp)
    assert len({*heads_classes, *mlp_classes, hidden}) == 5
    # Every parameter dim of size 256 is the residual hidden class.
    for param in graph.params():
        for dim, size in enumerate(param.shape):
            if size == 256:
                assert param.dim_classes[dim] == hidden, (param.name, dim)
    vocab = embedding.dim_classes[0]
    assert [e.kind for e in graph.events_for(vocab)] == ["gather"]
    token_ids = _input(graph, "token_ids")
    batch, seq = token_ids.dim_classes
    assert graph.classes[batch].shardable
    assert graph.classes[seq].unshardable_reason.startswith("appears twice")
    assert all(c.shardable for c in graph.classes if c.id in (hidden, vocab))


def test_gpt2_megatron_and_data_parallel_events(gpt2_graph):
    graph = gpt2_graph
    for i in range(2):
        layer = _gpt2_layer(graph, i)
        heads = layer["self_attention/query/kernel"].dim_classes[1]
        qk_dim = layer["self_attention/query/kernel"].dim_classes[2]
        v_dim = layer["self_attention/value/kernel"].dim_classes[2]
        mlp = layer["feedforward_intermediate_dense/kernel"].dim_classes[1]
        # Heads are a batch dim of the score/context einsums: only the output
        # projection contracts them (together with the value head_dim).
        (out_proj,) = graph.events_for(heads, phase="forward")
        assert set(out_proj.classes) == {heads, v_dim}
        # The score einsum contracts the query/key head_dim.
        (scores,) = graph.events_for(qk_dim, phase="forward")
        assert graph.tensors[scores.tensor].shape == (BATCH, 4, SEQ, SEQ)
        (down,) = graph.events_for(mlp, phase="forward")
        assert graph.tensors[down.tensor].shape == (BATCH, SEQ, 256)
        # Backward: one all-reduce of each block input (q/k/v and MLP-up grads).
        for cls in (heads, mlp):
            (event,) = graph.events_for(cls, phase="backward")
            assert event.kind == "contract"
            assert graph.tensors[event.tensor].shape == (BATCH, SEQ, 256)
    heads_and_mlp = {
        _gpt2_layer(graph, i)[name].dim_classes[1]
        for i in range(2)
        for name in (
            "self_attention/query/kernel",
            "feedforward_intermediate_dense/kernel",
        )
    }
    forward = _triggered(graph, heads_and_mlp, "forward")
    backward = _triggered(graph, heads_and_mlp, "backward")
    assert len(forward) == 4 and len(backward) == 4
    assert all(graph.tensors[e.tensor].shape == (BATCH, SEQ, 256) for e in forward)
    assert len({e.tensor for e in backward}) == 4
    counts = {
        (phase, kind): sum(
            1 for e in graph.comm_events if (e.phase, e.kind) == (phase, kind)
        )
        for phase in ("forward", "backward")
        for kind in ("contract", "gather")
    }
    # Per layer: q, k, v, scores, context, out-proj, MLP up, MLP down.
    assert counts["forward", "contract"] == 8 * 2
    assert counts["forward", "gather"] == 1
    # Data parallelism: every parameter's gradient is all-reduced once; the
    # position embedding's on the (SEQ, 256) slice that the model reads.
    batch = _input(graph, "token_ids").dim_classes[0]
    dp = _triggered(graph, {batch}, "backward")
    params = {p.id for p in graph.params()}
    pos = graph.param("position_embedding/embeddings")
    assert {e.tensor for e in dp} & params == params - {pos.id}
    (pos_event,) = [e for e in dp if e.tensor not in params]
    assert graph.tensors[pos_event.tensor].shape == (SEQ, 256)
    assert len(dp) == len(params)
    assert _triggered(graph, {batch}, "forward") == []


def test_llama_grouped_query_attention():
    import keras_hub

    model = keras_hub.models.LlamaBackbone(
        vocabulary_size=1000,
        num_layers=2,
        num_query_heads=8,
        num_key_value_heads=2,
        hidden_dim=256,
        intermediate_dim=512,
    )
    graph = trace_model(model, _token_inputs())
    edges = {(e.source, e.target): e.tensor for e in graph.slice_edges}
    hidden = graph.param("token_embedding/embeddings").dim_classes[1]
    for i in range(2):
        attn = f"transformer_layer_{i}/self_attention/"
        query = graph.param(attn + "query/kernel")
        q_heads, q_dim = query.dim_classes[1:]
        assert graph.param(attn + "attention_output/kernel").dim_classes[0] == q_heads
        assert graph.classes[q_heads].size == 8 and graph.classes[q_heads].shardable
        for name in ("key", "value"):
            kv_heads = graph.param(attn + name + "/kernel").dim_classes[1]
            assert kv_heads != q_heads and graph.classes[kv_heads].size == 2
            # jnp.repeat: broadcast_in_dim to (B, S, 2, 4, D), then a reshape
            # merging (2, 4) -> 8 heads; the major factor is the KV-head dim.
            (repeated,) = [
                t
                for t in graph.tensors
                if t.shape == (BATCH, SEQ, 2, 4, 32) and t.dim_classes[2] == kv_heads
            ]
            minor = graph.classes[repeated.dim_classes[3]]
            assert minor.unshardable_reason.startswith(
                "minor factor of reshape merge in layer "
            )
            # Backward, the all-reduce is on the un-repeated K/V (B, S, 2, D).
            source = graph.tensors[edges[kv_heads, q_heads]]
            assert source.shape == (BATCH, SEQ, 2, 32)
            assert source.dim_classes[2] == kv_heads
        # Rotary embedding splits head_dim in halves: head_dim is unshardable.
        assert "split" in graph.classes[q_dim].unshardable_reason
        (out_proj,) = graph.events_for(q_heads, phase="forward")
        assert graph.tensors[out_proj.tensor].shape == (BATCH, SEQ, 256)
        mlp = graph.param(f"transformer_layer_{i}/feedforward_gate_dense/kernel")
        up = graph.param(f"transformer_layer_{i}/feedforward_intermediate_dense/kernel")
        assert mlp.dim_classes == up.dim_classes == (hidden, mlp.dim_classes[1])
        assert len(graph.events_for(mlp.dim_classes[1], phase="forward")) == 1
    # Megatron with more model shards than KV heads: shard query heads and
    # MLP, replicate K/V. Per layer: two forward and two backward all-reduces
    # of (B, S, hidden), plus the K and V gradients through the repeat.
    sharded = {
        graph.param(f"transformer_layer_{i}/{name}").dim_classes[1]
        for i in range(2)
        for name in (
            "self_attention/query/kernel",
            "feedforward_gate_dense/kernel",
        )
    }
    for phase in ("forward", "backward"):
        events = _triggered(graph, sharded, phase)
        assert len(events) == 4
        assert all(graph.tensors[e.tensor].shape == (BATCH, SEQ, 256) for e in events)
    sliced = [e for e in graph.slice_edges if e.target in sharded]
    assert len(sliced) == 4 and not {e.source for e in sliced} & sharded
    assert graph.unknown_primitives == ()


def _cnn(head: keras.layers.Layer) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((12, 12, 3)),
            keras.layers.Conv2D(8, 3, activation="relu", name="conv1"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(16, 3, name="conv2"),
            head,
            keras.layers.Dense(10, name="head"),
        ],
        name="cnn",
    )


def test_sequential_cnn():
    x = jax.ShapeDtypeStruct((4, 12, 12, 3), "float32")
    graph = trace_model(_cnn(keras.layers.GlobalAveragePooling2D()), x)
    conv1, conv2 = graph.param("cnn/conv1/kernel"), graph.param("cnn/conv2/kernel")
    image = _input(graph, "x")
    for tensor, layer in ((conv1, "conv1"), (conv2, "conv2")):
        spatial = f"spatial dim of conv_general_dilated in layer {layer!r}"
        for dim in (0, 1):
            assert graph.classes[tensor.dim_classes[dim]].unshardable_reason == spatial
    for dim in (1, 2):
        assert not graph.classes[image.dim_classes[dim]].shardable
    assert conv1.dim_classes[2] == image.dim_classes[3]
    c1, c2 = conv1.dim_classes[3], conv2.dim_classes[3]
    assert graph.param("cnn/conv1/bias").dim_classes == (c1,) == (conv2.dim_classes[2],)
    assert graph.param("cnn/conv2/bias").dim_classes == (c2,)
    assert graph.param("cnn/head/kernel").dim_classes[0] == c2
    assert graph.classes[c1].shardable and graph.classes[c2].shardable
    (conv2_out,) = graph.events_for(c1, phase="forward")
    assert graph.tensors[conv2_out.tensor].shape == (4, 3, 3, 16)
    assert conv2_out.primitive == "conv_general_dilated"
    (head_out,) = graph.events_for(c2, phase="forward", kind="contract")
    assert graph.tensors[head_out.tensor].shape == (4, 10)
    # The global average pool reduces the (unshardable) spatial dims only.
    batch = image.dim_classes[0]
    assert graph.classes[batch].shardable
    assert all(t.dim_classes[0] == batch for t in graph.tensors if t.shape[:1] == (4,))
    # Flatten merges (H, W, C): the channel class becomes a minor factor.
    flat = trace_model(_cnn(keras.layers.Flatten(name="flatten")), x)
    c2_flat = flat.param("cnn/conv2/kernel").dim_classes[3]
    reason = flat.classes[c2_flat].unshardable_reason
    assert reason == "minor factor of reshape merge in layer 'flatten'"
    head_in = flat.param("cnn/head/kernel").dim_classes[0]
    assert any(e.target == head_in for e in flat.slice_edges)


_foo_p = Primitive("autoshard_test_foo")
_foo_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))


def test_unknown_primitive_is_conservative(caplog):
    def f(w1, w2, x):
        return _foo_p.bind(x @ w1) @ w2

    specs = [(16, 64), (64, 16), (8, 16)]
    closed = jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct(s, "float32") for s in specs])
    kinds = [("param", "w1"), ("param", "w2"), ("input", "x")]
    with caplog.at_level(logging.WARNING):
        graph = build_axis_graph(closed, kinds)
    assert graph.unknown_primitives == (("autoshard_test_foo", 1),)
    assert "autoshard_test_foo" in caplog.text
    reason = "unknown primitive 'autoshard_test_foo'"
    w1, w2 = graph.param("w1"), graph.param("w2")
    x = _input(graph, "x")
    for cls in (w1.dim_classes[1], w2.dim_classes[0], x.dim_classes[0]):
        assert graph.classes[cls].unshardable_reason == reason
    # Dims the unknown op never touched stay shardable.
    assert graph.classes[w1.dim_classes[0]].shardable
    assert graph.classes[w2.dim_classes[1]].shardable


class _Foo(keras.layers.Layer):
    """A layer whose primitive JAX can shape but not differentiate."""

    def call(self, x):
        return _foo_p.bind(x)


def test_residuals_jax_cannot_tell_are_a_note_naming_primitive_and_layer():
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, name="up"),
            _Foo(name="foo"),
            keras.layers.Dense(16, name="down"),
        ],
        name="mlp",
    )
    graph = trace_model(model, jax.ShapeDtypeStruct((8, 16), "float32"))
    (note,) = [n for n in graph.notes if "autoshard_test_foo" in n]
    assert "unknown to JAX" in note and "in layer 'foo'" in note
    assert "operands are assumed kept" in note
    # The fallback stands: the primitive's operand (up's output) is kept,
    # besides its output, which down's product keeps.
    hidden = {
        k.tensor for k in graph.residuals if graph.tensors[k.tensor].shape == (8, 32)
    }
    assert len(hidden) == 2


def test_asking_jax_for_a_custom_jvp_calls_residuals_is_not_deprecated(monkeypatch):
    """The one-equation jaxpr that asks JAX what a ReLU (a custom JVP call)
    keeps carries debug info: JAX deprecates a Jaxpr without one."""
    monkeypatch.setattr(residuals, "_CACHE", {})  # asked afresh, not cached

    def f(w, x):
        return jax.nn.relu(x @ w)

    specs = [jax.ShapeDtypeStruct(s, "float32") for s in [(16, 32), (8, 16)]]
    closed = jax.make_jaxpr(f)(*specs)
    assert any(e.primitive.name == "custom_jvp_call" for e in closed.jaxpr.eqns)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        graph = build_axis_graph(closed, [("param", "w"), ("input", "x")])
    assert graph.residuals  # what the ReLU keeps, asked of JAX


def test_scan_over_layers_with_cond():
    layers, batch, hidden, ffn = 3, 4, 8, 32

    def f(w1s, w2s, x):
        def body(h, ws):
            w1, w2 = ws
            y = jnp.tanh(h @ w1)
            y = lax.cond(jnp.sum(y) > 0, lambda t: t * 2.0, lambda t: -t, y)
            return h + y @ w2, None

        return lax.scan(body, x, (w1s, w2s))[0]

    shapes = [(layers, hidden, ffn), (layers, ffn, hidden), (batch, hidden)]
    closed = jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct(s, "float32") for s in shapes])
    kinds = [("param", "w1s"), ("param", "w2s"), ("input", "x")]
    graph = build_axis_graph(closed, kinds)
    w1s, w2s, x = graph.param("w1s"), graph.param("w2s"), _input(graph, "x")
    assert graph.classes[w1s.dim_classes[0]].unshardable_reason == "scanned dim of scan"
    mlp, model_dim = w1s.dim_classes[2], w1s.dim_classes[1]
    assert w2s.dim_classes[1:] == (mlp, model_dim)
    # The carry is unified across the loop boundary: input and result alike.
    (result,) = [graph.tensors[-1]]
    assert result.shape == (batch, hidden)
    assert result.dim_classes == x.dim_classes == (x.dim_classes[0], model_dim)
    # Every (batch, ffn) tensor, in both cond branches, carries the mlp class.
    ffn_tensors = [t for t in graph.tensors if t.shape == (batch, ffn)]
    assert len(ffn_tensors) >= 5
    assert all(t.dim_classes[1] == mlp for t in ffn_tensors)
    (down,) = graph.events_for(mlp, phase="forward", kind="contract")
    assert down.multiplicity == layers
    # The cond predicate sums y over the mlp dim: a forward reduce, too.
    (predicate,) = graph.events_for(mlp, phase="forward", kind="reduce")
    assert graph.tensors[predicate.tensor].shape == ()
    backward = graph.events_for(x.dim_classes[0], phase="backward")
    assert len(backward) == 2 and all(e.multiplicity == layers for e in backward)
    assert graph.notes == ()


def test_while_loop_unifies_carries_and_notes_trip_count():
    def f(w, x):
        def body(state):
            i, h = state
            return i + 1, jnp.tanh(h @ w)

        return lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]

    specs = [jax.ShapeDtypeStruct((8, 8), "float32")] * 2
    graph = build_axis_graph(
        jax.make_jaxpr(f)(*specs), [("param", "w"), ("input", "x")]
    )
    w, x = graph.param("w"), _input(graph, "x")
    # h @ w feeds back into h: both dims of w are the same class.
    assert w.dim_classes[0] == w.dim_classes[1] == x.dim_classes[1]
    assert graph.classes[w.dim_classes[0]].unshardable_reason.startswith(
        "appears twice"
    )
    assert any("while" in note for note in graph.notes)
    assert all(e.multiplicity == 1 for e in graph.comm_events)


def test_graph_needs_no_weights():
    # A 16 GiB kernel: only its shape and dtype exist.
    def f(w, x):
        return jnp.tanh(x @ w)

    w = jax.ShapeDtypeStruct((65536, 65536), "float32")
    x = jax.ShapeDtypeStruct((4, 65536), "float32")
    closed = jax.make_jaxpr(f)(w, x)
    graph = build_axis_graph(closed, [("param", "w"), ("input", "x")])
    (param,) = graph.params()
    assert param.nbytes == 65536 * 65536 * 4
    assert param.requires_grad and not _input(graph, "x").requires_grad
    assert "AxisGraph" in graph.summary()


def test_bfloat16_residuals_read_by_matmuls_are_kept_at_float32_width_on_cpu():
    """XLA:CPU keeps the float32 copies of a product's bfloat16 operands
    (kernel casts, the product's input) for the backward pass, and other
    bfloat16 residuals (a gate's two factors) at their own width."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        x = keras.Input((16,))
        gated = keras.layers.Multiply()(
            [
                keras.layers.Dense(64, name="gate")(x),
                keras.layers.Dense(64, name="up")(x),
            ]
        )
        model = keras.Model(x, keras.layers.Dense(16, name="down")(gated))
        graph = trace_model(model, jax.ShapeDtypeStruct((8, 16), "float32"))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    widths = {}
    for kept in graph.residuals:
        tensor = graph.tensors[kept.tensor]
        if tensor.itemsize == 2:
            on_cpu = kept_widening(graph, tensor, half_as_single=True)
            widths.setdefault(tensor.shape, set()).add(on_cpu)
            assert kept_widening(graph, tensor, half_as_single=False) == 1.0
    # Read by products: the input's cast (which gate's and up's kernel
    # gradients need; their kernels' casts are not kept, the input has no
    # gradient), down's kernel cast and the gated product. Read only by the
    # multiply: the gate's and up's outputs.
    assert widths == {(64, 16): {2.0}, (8, 16): {2.0}, (8, 64): {1.0, 2.0}}
    products = [
        t
        for t in graph.tensors
        if t.shape == (8, 64) and t.id in graph.matmul_operand_ids
    ]
    assert len(products) == 1
