"""The activations XLA's partitioner cuts after a storage cut it does not
gather (`stream_drift.held_as_partitioned`), on a model written here."""

from __future__ import annotations

import jax
import keras

from keras_autoshard.graph.builder import build_axis_graph
from keras_autoshard.planner.cost_model import Assignment, local_bytes, tensor_axes
from keras_autoshard.planner.stream_drift import (
    held_as_partitioned,
    merged_group_cuts,
)
from keras_autoshard.trace.tracer import trace_model

HIDDEN = 64
SIZES = {"batch": 2, "model": 4}


class Scale(keras.layers.Layer):
    """A norm's scale: a one-dimensional weight read elementwise."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(HIDDEN,), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


class Block(keras.layers.Layer):
    """A residual block: a scale, then two matrix products. The plan pins
    the output of a layer whose weight is cut for storage only (the
    scale's), so the block's own output is free to drift."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = Scale(name="norm")

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.up = self.add_weight(shape=(HIDDEN, 4 * HIDDEN), name="up")
        self.down = self.add_weight(shape=(4 * HIDDEN, HIDDEN), name="down")

    def call(self, x):
        h = keras.ops.relu(keras.ops.matmul(self.norm(x), self.up))
        return x + keras.ops.matmul(h, self.down)


def _graph():
    tokens = keras.Input((16,), dtype="int32", batch_size=8)
    x = keras.layers.Embedding(100, HIDDEN, name="table")(tokens)
    for i in range(3):
        x = Block(name=f"block_{i}")(x)
    model = keras.Model(tokens, x)
    traced = trace_model(model, jax.ShapeDtypeStruct((8, 16), "int32"))
    return build_axis_graph(traced.closed_jaxpr, traced.invar_kinds)


def _hidden_class(graph):
    return graph.param("block_0/norm/scale").dim_classes[0]


def _layer_input_ids(graph):
    return {t for _, ids in graph.layer_inputs for t in ids}


def test_a_scale_stored_cut_on_an_uncut_class_cuts_the_stream_between_layers():
    graph = _graph()
    hidden = _hidden_class(graph)
    fsdp = {f"block_{i}/norm/scale": ((0, "model"),) for i in range(3)}
    held = held_as_partitioned(graph, Assignment(class_axis={}, fsdp=fsdp), SIZES)
    between = _layer_input_ids(graph)
    assert len(between) >= 3
    sizes = SIZES
    for tensor_id in between:
        tensor = graph.tensors[tensor_id]
        assert hidden in tensor.dim_classes
        dim = tensor.dim_classes.index(hidden)
        assert (dim, "model") in held.activation_cuts[tensor_id]
        whole = local_bytes(tensor, Assignment(class_axis={}), sizes)
        assert local_bytes(tensor, held, sizes) == whole / 4
    # Inside a layer the plan's cuts stay: only the stream between layers.
    inside = [
        t.id
        for t in graph.tensors
        if t.kind == "activation" and hidden in t.dim_classes and t.id not in between
    ]
    assert inside and not any(t in held.activation_cuts for t in inside)


def test_no_drift_where_the_class_is_computed_cut_or_the_axis_is_taken():
    graph = _graph()
    hidden = _hidden_class(graph)
    fsdp = {"block_1/norm/scale": ((0, "model"),)}
    # The class is computed cut over `batch`: the scale is gathered with it.
    computed = Assignment(class_axis={hidden: "batch"}, fsdp=fsdp)
    assert held_as_partitioned(graph, computed, SIZES) == computed
    # The activations' batch dim already takes the axis the scale is cut on.
    batch = graph.tensors[next(iter(_layer_input_ids(graph)))].dim_classes[0]
    taken = Assignment(class_axis={batch: "model"}, fsdp=fsdp)
    held = held_as_partitioned(graph, taken, SIZES)
    for tensor_id in _layer_input_ids(graph):
        assert tensor_axes(graph.tensors[tensor_id], held).count("model") == 1


def test_a_table_cut_for_storage_moves_no_activation():
    """A gathered table (the embedding, read by a gather) is all-gathered
    where it is read: XLA:GPU's Llama-2-70B on 32x8, its table cut over
    `model` on the hidden dim, holds its layers' inputs whole."""
    graph = _graph()
    fsdp = {"table/embeddings": ((1, "model"),)}
    assignment = Assignment(class_axis={}, fsdp=fsdp)
    assert held_as_partitioned(graph, assignment, SIZES) == assignment


def test_a_kernel_cut_for_storage_on_a_whole_class_cuts_the_stream():
    """A matrix product's kernel stored cut over an axis that cuts no token
    dim, on a dim the plan computes whole, is not gathered: XLA:GPU's
    Llama-2-70B on 16x16, its key and value kernels cut over `model` on the
    hidden dim, holds each layer's checkpointed input a sixteenth as large
    (`stream_drift.kernel_drift`; this test said the opposite until that
    program was read, with nothing measured behind it). Over the axis that
    carries the tokens (FSDP) the kernel is gathered and nothing moves."""
    graph = _graph()
    hidden = _hidden_class(graph)
    fsdp = {"block_0/up": ((0, "model"),)}
    held = held_as_partitioned(graph, Assignment(class_axis={}, fsdp=fsdp), SIZES)
    for tensor_id in _layer_input_ids(graph):
        tensor = graph.tensors[tensor_id]
        dim = tensor.dim_classes.index(hidden)
        assert (dim, "model") in held.activation_cuts[tensor_id]
    batch = graph.tensors[next(iter(_layer_input_ids(graph)))].dim_classes[0]
    fsdp_over_tokens = Assignment(
        class_axis={batch: "batch"}, fsdp={"block_0/up": ((0, "batch"),)}
    )
    assert held_as_partitioned(graph, fsdp_over_tokens, SIZES) == fsdp_over_tokens


def test_a_kernel_cut_reaches_only_the_activations_it_is_given_beyond_the_stream():
    """Beyond the stream, a kernel's storage cut reaches the activations
    `held_as_partitioned` is given (`reached`: those kept from the forward
    pass to the backward pass, and those rematerialized layers make again,
    `accelerator_peak`), not the others a layer makes inside its call.
    Read off XLA:GPU's Llama-2-70B widths on 16x16 at 4 layers, none
    rematerialized: the layers' kept activations of the hidden class are
    held cut over `model`; at 3 layers, the lower 2 rematerialized, so are
    their recomputed norm outputs (`[512, 8, 4096]`,
    `tests/planner/test_drift_copies_gpu.py`)."""
    graph = _graph()
    hidden = _hidden_class(graph)
    between = _layer_input_ids(graph)
    inside = [
        t.id
        for t in graph.tensors
        if t.kind == "activation" and hidden in t.dim_classes and t.id not in between
    ]
    reached, others = frozenset(inside[:1]), inside[1:]
    assert others
    fsdp = {"block_0/up": ((0, "model"),)}
    assignment = Assignment(class_axis={}, fsdp=fsdp)
    held = held_as_partitioned(graph, assignment, SIZES, reached)
    (tensor_id,) = reached
    tensor = graph.tensors[tensor_id]
    assert local_bytes(tensor, held, SIZES) == tensor.nbytes / SIZES["model"]
    assert not any(t in held.activation_cuts for t in others)


QUERY_HEADS, KEY_VALUE_HEADS, HEAD_DIM, TOKENS = 8, 2, 16, 32


class GroupedAttention(keras.layers.Layer):
    """Grouped key/value heads: 2 repeated 4 times to meet 8 query heads."""

    def build(self, input_shape):
        def kernel(name, *shape):
            return self.add_weight(shape=shape, name=name)

        self.query = kernel("query", HIDDEN, QUERY_HEADS, HEAD_DIM)
        self.key = kernel("key", HIDDEN, KEY_VALUE_HEADS, HEAD_DIM)
        self.value = kernel("value", HIDDEN, KEY_VALUE_HEADS, HEAD_DIM)
        self.out = kernel("out", QUERY_HEADS, HEAD_DIM, HIDDEN)

    def call(self, x):
        ops, repeats = keras.ops, QUERY_HEADS // KEY_VALUE_HEADS
        q = ops.einsum("bsm,mhd->bshd", x, self.query)
        k = ops.repeat(ops.einsum("bsm,mhd->bshd", x, self.key), repeats, axis=2)
        v = ops.repeat(ops.einsum("bsm,mhd->bshd", x, self.value), repeats, axis=2)
        probs = ops.softmax(ops.einsum("bshd,bthd->bhst", q, k), axis=-1)
        attended = ops.einsum("bhst,bthd->bshd", probs, v)
        return ops.einsum("bshd,hdm->bsm", attended, self.out)


def test_repeated_key_value_heads_are_held_cut_as_the_query_heads():
    """Query heads cut 8 ways while the 2 key/value heads stay whole: the
    repeated keys and values (`(batch, tokens, 2, 4, head_dim)`, merged
    into the 8 heads) are held cut over the query heads' axis, 8 ways
    (`merged_group_cuts`). XLA:GPU's Llama-2-70B widths on 16x16 (8
    key/value heads, 64 query heads) keep them as 32 MiB buffers per layer;
    counted whole they were 512 MiB each, the estimate 1.19 of the compiled
    peak at 4 layers (0.99 with this)."""
    x = keras.Input((TOKENS, HIDDEN), batch_size=4)
    model = keras.Model(x, GroupedAttention(name="attention")(x))
    traced = trace_model(model, jax.ShapeDtypeStruct((4, TOKENS, HIDDEN), "float32"))
    graph = build_axis_graph(traced.closed_jaxpr, traced.invar_kinds)
    heads = graph.param("attention/query").dim_classes[1]
    sizes = {"batch": 1, "model": 8}
    assignment = Assignment(class_axis={heads: "model"})
    repeated = [
        t for t in graph.tensors if t.shape == (4, TOKENS, KEY_VALUE_HEADS, 4, HEAD_DIM)
    ]
    assert len(repeated) == 2  # keys and values
    held = held_as_partitioned(graph, assignment, sizes)
    for tensor in repeated:
        assert local_bytes(tensor, assignment, sizes) == tensor.nbytes
        assert local_bytes(tensor, held, sizes) == tensor.nbytes / 8
    # The unrepeated keys stay whole: 2 heads cannot be cut 8 ways.
    unrepeated = [
        t for t in graph.tensors if t.shape == (4, TOKENS, KEY_VALUE_HEADS, HEAD_DIM)
    ]
    assert unrepeated
    cuts = merged_group_cuts(graph, assignment, sizes)
    assert not any(t.id in cuts for t in unrepeated)


def _products_reading(graph, kernel_name):
    """`(output, activation operand)` of the products reading `kernel_name`."""
    kernel = graph.param(kernel_name).id
    return [
        (out, lhs if rhs == kernel else rhs)
        for out, lhs, rhs, _ in graph.products
        if kernel in (lhs, rhs)
    ]


def test_a_scale_cut_reaches_what_the_backward_pass_keeps():
    """A norm scale's storage cut reaches the activations a layer that is
    not rematerialized keeps (its norm's output), as a kernel's does.
    Read off XLA:GPU's Llama-2-70B widths on 16x16 at 11 layers, the lower
    2 rematerialized: each upper layer's attention and feed-forward norm
    outputs are held cut over `model` (32 MiB); counted whole (512 MiB)
    the estimate was 1.19 of the compiled peak."""
    graph = _graph()
    ((_, normed),) = _products_reading(graph, "block_1/up")
    fsdp = {f"block_{i}/norm/scale": ((0, "model"),) for i in range(3)}
    assignment = Assignment(class_axis={}, fsdp=fsdp)
    held = held_as_partitioned(graph, assignment, SIZES, frozenset({normed}))
    tensor = graph.tensors[normed]
    assert local_bytes(tensor, held, SIZES) == tensor.nbytes / SIZES["model"]
    assert normed not in held_as_partitioned(graph, assignment, SIZES).activation_cuts


def _relu_output(graph, block):
    """The ReLU output `block`'s `down` reads: its largest activation."""
    ((_, relu),) = _products_reading(graph, f"{block}/down")
    return relu


def _gathered(graph, assignment, remat, kept, recomputed=frozenset(), peaks=None):
    """`gathered_by_stage`, each rematerialized block peaking at its ReLU
    output's gradient (its largest activation's), unless `peaks` says."""
    from keras_autoshard.planner.stream_drift import gathered_by_stage

    if peaks is None:
        peaks = {block: _relu_output(graph, block) for block in remat}
    held = held_as_partitioned(graph, assignment, SIZES, kept | recomputed)
    return gathered_by_stage(
        graph, assignment, held, SIZES, remat, kept, recomputed, peaks
    )


def test_gathered_copies_are_held_until_the_weight_gradients_at_the_end():
    """Where a storage cut's drift holds a kept activation cut, XLA:GPU
    forms a layer's weight gradients at the end of the backward pass from
    gathered copies (`stream_drift.gathered_by_stage`): the kept input of a
    product the plan computes cut over the axis is gathered in the layer's
    backward pass, and so is the gradient of a product's output the drift
    holds cut (the row-parallel `down`), each held from its layer's
    backward pass (the stages below it) to the end; the input of a product
    computed whole over the axis keeps the forward pass's gathered copy
    (every stage). Read off XLA:GPU's Llama-2-70B widths on 16x16, 5
    layers, the lower 2 rematerialized: five 512 MiB copies per upper
    layer while the lower layers' backward passes run (estimate 0.75 of
    that peak without them, at 3 layers)."""
    from keras_autoshard.planner.remat import layer_calls

    graph = _graph()
    order = layer_calls(graph)
    hidden = _hidden_class(graph)
    fsdp = {f"block_{i}/norm/scale": ((0, "model"),) for i in range(3)}
    ((up_out, normed),) = _products_reading(graph, "block_1/up")
    ((down_out, _),) = _products_reading(graph, "block_1/down")
    mlp = graph.tensors[up_out].dim_classes[-1]
    assert mlp != hidden
    kept = frozenset({normed})
    position = order.index("block_1")
    remat = frozenset({"block_0", "block_2"})  # block_1 is not rematerialized

    # `up` computed cut over `model` (Megatron): its input is gathered
    # again in block_1's backward pass, as is `down`'s output gradient.
    megatron = Assignment(class_axis={mlp: "model"}, fsdp=fsdp)
    whole = Assignment(class_axis={mlp: "model"})
    late = local_bytes(graph.tensors[normed], whole, SIZES) + local_bytes(
        graph.tensors[down_out], whole, SIZES
    )
    stages = _gathered(graph, megatron, remat, kept)
    assert len(stages) == len(order) + 1
    assert stages == [late if i < position else 0.0 for i in range(len(stages))]
    # `up` computed whole over `model`: the forward pass's gathered copy of
    # its input, at every stage; `down`'s output gradient as before.
    replicated = Assignment(class_axis={}, fsdp=fsdp)
    copy = local_bytes(graph.tensors[normed], Assignment(class_axis={}), SIZES)
    gradient = local_bytes(graph.tensors[down_out], Assignment(class_axis={}), SIZES)
    stages = _gathered(graph, replicated, remat, kept)
    assert stages == [
        copy + (gradient if i < position else 0.0) for i in range(len(stages))
    ]
    # Rematerialized, block_1 makes its activations again: none is kept
    # (its copies: `test_a_rematerialized_layer_holds_copies_at_its_own_stage`).
    assert set(_gathered(graph, megatron, remat | {"block_1"}, kept)) == {0.0}
    # No storage cut, no drift, no copy.
    assert set(_gathered(graph, whole, remat, kept)) == {0.0}


def test_a_kernels_cut_keeps_no_forward_copy():
    """Where a kernel's storage cut (not a norm scale's) holds a kept input
    cut, the forward pass's gathered copy for a product computed whole over
    the axis is freed after the forward pass. Read off XLA:GPU's
    Llama-2-70B widths on 16x16 with the key kernel stored cut over
    `model` on its hidden dim, 12 layers, 9 kept: the norm outputs are
    gathered for the query and feed-forward products and not held (the
    estimate was 1.14 of the compiled peak counting one 512 MiB copy per
    kept layer, 1.02 without)."""
    from keras_autoshard.planner.remat import layer_calls

    graph = _graph()
    order = layer_calls(graph)
    ((_, normed),) = _products_reading(graph, "block_1/up")
    ((down_out, _),) = _products_reading(graph, "block_1/down")
    kept = frozenset({normed})
    position = order.index("block_1")
    remat = frozenset({"block_0", "block_2"})
    # `up` and `down` stored cut over `model` on the hidden dim: it drifts.
    kernels = {"block_1/up": ((0, "model"),), "block_1/down": ((1, "model"),)}
    by_kernels = Assignment(class_axis={}, fsdp=kernels)
    gradient = local_bytes(graph.tensors[down_out], Assignment(class_axis={}), SIZES)
    stages = _gathered(graph, by_kernels, remat, kept)
    # No forward copy of `normed` at any stage; `down`'s output gradient,
    # gathered in block_1's backward pass, as under a scale's cut.
    assert stages == [gradient if i < position else 0.0 for i in range(len(stages))]


def test_a_rematerialized_layer_holds_copies_at_its_own_stage():
    """A rematerialized layer recomputes its activations held cut and
    gathers the same copies as one that keeps them, held inside its own
    backward pass only (its weight gradients are formed at the end of it):
    at its peak, where its largest activation's gradient is formed, the
    copies of the products whose backward passes ran before it (they read
    only later activations). Block_1 peaking at its ReLU output, the
    input of its last product, holds none (the zoo's subclassed model on
    2x4 under 75 % of its free peak: no copy at its peak inside its
    feed-forward products, `benchmarks/tests/test_peak_buffers.py`);
    peaking at its input, before both products, it holds `up`'s gathered
    input and `down`'s gathered output gradient (Llama-2-70B widths on
    16x16 at 3 layers: the lowest layer's attention peaks holding the
    feed-forward copies, `stream_drift.gathered_by_stage`)."""
    from keras_autoshard.planner.remat import layer_calls

    graph = _graph()
    order = layer_calls(graph)
    fsdp = {f"block_{i}/norm/scale": ((0, "model"),) for i in range(3)}
    ((up_out, normed),) = _products_reading(graph, "block_1/up")
    ((down_out, _),) = _products_reading(graph, "block_1/down")
    mlp = graph.tensors[up_out].dim_classes[-1]
    megatron = Assignment(class_axis={mlp: "model"}, fsdp=fsdp)
    whole = Assignment(class_axis={mlp: "model"})
    blocks = [f"block_{i}" for i in range(3)]
    remat = frozenset(blocks)
    recomputed = frozenset({normed})
    position = order.index("block_1")
    at_relu = {block: _relu_output(graph, block) for block in blocks}

    assert set(_gathered(graph, megatron, remat, frozenset(), recomputed)) == {0.0}
    (block_input,) = dict(graph.layer_inputs)["block_1"]
    before_both = {**at_relu, "block_1": block_input}
    at_input = _gathered(graph, megatron, remat, frozenset(), recomputed, before_both)
    copies = local_bytes(graph.tensors[normed], whole, SIZES) + local_bytes(
        graph.tensors[down_out], whole, SIZES
    )
    assert at_input == [copies if i == position else 0.0 for i in range(len(at_input))]
    # Its norm's output not recomputed cut (no drift reaches it there):
    # only `down`'s output gradient.
    not_cut = _gathered(graph, megatron, remat, frozenset(), frozenset(), before_both)
    gradient = local_bytes(graph.tensors[down_out], whole, SIZES)
    assert not_cut == [gradient if i == position else 0.0 for i in range(len(not_cut))]


class LoraBlock(Block):
    """`Block` with a low-rank update added to `up`: a product of two
    weights, which reads no activation."""

    def build(self, input_shape):
        super().build(input_shape)
        self.lora_a = self.add_weight(shape=(HIDDEN, 4), name="lora_a")
        self.lora_b = self.add_weight(shape=(4, 4 * HIDDEN), name="lora_b")

    def call(self, x):
        up = self.up + keras.ops.matmul(self.lora_a, self.lora_b)
        h = keras.ops.relu(keras.ops.matmul(self.norm(x), up))
        return x + keras.ops.matmul(h, self.down)


def test_a_product_of_two_weights_in_a_rematerialized_layer_is_no_copy():
    """A product that reads no activation (a LoRA update's `a @ b`) has no
    backward pass before the layer's peak to gather a copy for: the
    rematerialized layer's copies are those of its other products, here
    `down`'s output gradient where the layer peaks at its input."""
    tokens = keras.Input((16,), dtype="int32", batch_size=8)
    x = keras.layers.Embedding(100, HIDDEN, name="table")(tokens)
    model = keras.Model(tokens, LoraBlock(name="block_0")(x))
    traced = trace_model(model, jax.ShapeDtypeStruct((8, 16), "int32"))
    graph = build_axis_graph(traced.closed_jaxpr, traced.invar_kinds)
    params = {t.id for t in graph.tensors if t.kind == "param"}
    assert any({lhs, rhs} <= params for _, lhs, rhs, _ in graph.products)
    ((down_out, _),) = _products_reading(graph, "block_0/down")
    assignment = Assignment(class_axis={}, fsdp={"block_0/norm/scale": ((0, "model"),)})
    remat = frozenset({"block_0"})
    (block_input,) = dict(graph.layer_inputs)["block_0"]
    stages = _gathered(
        graph, assignment, remat, frozenset(), frozenset(), {"block_0": block_input}
    )
    gradient = local_bytes(graph.tensors[down_out], Assignment(class_axis={}), SIZES)
    assert sorted(set(stages)) == [0.0, gradient]
