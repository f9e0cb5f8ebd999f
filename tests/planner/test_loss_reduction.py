"""Unit tests of `planner/loss_reduction.py` on small Keras models traced
here: which reduction XLA:GPU packs with the loss's, and its bytes."""

import jax
import keras

from keras_autoshard.graph.builder import build_axis_graph
from keras_autoshard.planner.cost_model import Assignment
from keras_autoshard.planner.loss_reduction import loss_combined_reductions
from keras_autoshard.trace.tracer import trace_model
from tests.planner.small_models import TableTwice

BATCH, TOKENS, WIDTH, CLASSES, VOCABULARY = 8, 16, 32, 16, 64
SIZES = {"model": 8}


def traced(model, sample):
    closed = trace_model(model, sample)
    return build_axis_graph(closed.closed_jaxpr, closed.invar_kinds).for_platform("gpu")


def dense_head_graph():
    x = keras.Input((TOKENS, WIDTH), batch_size=BATCH)
    hidden = keras.layers.Dense(WIDTH, activation="relu", name="hidden")(x)
    model = keras.Model(x, keras.layers.Dense(CLASSES, name="head")(hidden))
    sample = jax.ShapeDtypeStruct((BATCH, TOKENS, WIDTH), "float32")
    return traced(model, sample)


def test_a_head_whose_outputs_are_cut_reduces_its_input_gradient():
    graph = dense_head_graph()
    classes = graph.param("head/kernel").dim_classes[1]
    cut = Assignment(class_axis={classes: "model"})
    (found,) = loss_combined_reductions(graph, cut, SIZES)
    _, size, per_batch = found
    # The head's input, float32 and whole on every device.
    assert (size, per_batch) == (4 * BATCH * TOKENS * WIDTH, True)


def test_a_head_cut_nowhere_or_by_its_rows_combines_nothing():
    graph = dense_head_graph()
    assert loss_combined_reductions(graph, Assignment({}), SIZES) == []
    # Its rows cut with its input's width (Megatron's row-parallel layer):
    # the outputs are whole, the loss reduces over nothing.
    width = graph.param("head/kernel").dim_classes[0]
    rows = Assignment(class_axis={width: "model"})
    assert loss_combined_reductions(graph, rows, SIZES) == []


def table_twice_graph():
    model = TableTwice(VOCABULARY, WIDTH)
    model.build((BATCH, TOKENS))
    return traced(model, jax.ShapeDtypeStruct((BATCH, TOKENS), "int32"))


def _batch_class(graph) -> int:
    (output,) = graph.outputs
    return graph.tensors[output].dim_classes[0]


def test_a_table_read_twice_reduces_its_projection_gradient():
    graph = table_twice_graph()
    over_model = Assignment(class_axis={_batch_class(graph): "model"})
    (found,) = loss_combined_reductions(graph, over_model, SIZES)
    _, size, per_batch = found
    # The whole table's gradient, whatever the batch.
    assert (size, per_batch) == (4 * VOCABULARY * WIDTH, False)


def test_a_table_stored_cut_is_reduce_scattered_apart_from_the_loss():
    graph = table_twice_graph()
    # The model's name leads the path (`table_twice`, `table_twice_1`, ...).
    (table,) = [
        t.name
        for t in graph.tensors
        if t.kind == "param" and t.name.endswith("/table/embeddings")
    ]
    stored_cut = Assignment(
        class_axis={_batch_class(graph): "model"}, fsdp={table: ((0, "model"),)}
    )
    assert loss_combined_reductions(graph, stored_cut, SIZES) == []
