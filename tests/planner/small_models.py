"""Small models and their axis graphs for the planner's unit tests: an
embedding and two residual MLP blocks (`blocks_model`), traced over shapes
only, and an embedding table read twice (`TableTwice`)."""

from __future__ import annotations

import functools

import jax
import keras

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.graph.builder import build_axis_graph
from keras_autoshard.planner.cost_model import MeshAxis
from keras_autoshard.trace.tracer import trace_model

BATCH, TOKENS, WIDTH, HIDDEN, VOCABULARY = 4, 8, 16, 64, 50
TOKEN_IDS = jax.ShapeDtypeStruct((BATCH, TOKENS), "int32")
SIZES = {"batch": 2, "model": 4}
AXES = tuple(MeshAxis.named(name, size) for name, size in SIZES.items())


class Block(keras.layers.Layer):
    """A residual MLP: `x + down(relu(up(x)))`."""

    def build(self, input_shape):
        self.up = keras.layers.Dense(HIDDEN, name="up")
        self.up.build(input_shape)
        self.down = keras.layers.Dense(WIDTH, name="down")
        self.down.build((*input_shape[:-1], HIDDEN))

    def call(self, x):
        return x + self.down(keras.ops.relu(self.up(x)))


class TableTwice(keras.Model):
    """Token ids -> rows of an embedding table -> a ReLU Dense -> scores
    against every row of the same table (the table read again as the
    output projection)."""

    def __init__(self, vocabulary: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.table = keras.layers.Embedding(vocabulary, width, name="table")
        self.hidden = keras.layers.Dense(width, activation="relu", name="hidden")

    def build(self, input_shape):
        self.table.build(input_shape)
        self.hidden.build((*input_shape, self.table.output_dim))

    def call(self, token_ids):
        rows = self.hidden(self.table(token_ids))
        return keras.ops.matmul(rows, keras.ops.transpose(self.table.embeddings))


def blocks_model() -> keras.Model:
    """Token ids → an embedding table → `block`, `block_1` (functional)."""
    tokens = keras.Input((TOKENS,), dtype="int32", batch_size=BATCH)
    x = keras.layers.Embedding(VOCABULARY, WIDTH, name="table")(tokens)
    for name in ("block", "block_1"):
        x = Block(name=name)(x)
    return keras.Model(tokens, x)


@functools.cache
def blocks_graph() -> AxisGraph:
    """The axis graph of `blocks_model`'s forward pass."""
    traced = trace_model(blocks_model(), TOKEN_IDS)
    return build_axis_graph(traced.closed_jaxpr, traced.invar_kinds)


class Net(keras.Model):
    """The two blocks of `blocks_model` in a subclassed model named `net`:
    its variable paths start with the model's name, its trace scopes do
    not."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = Block(name="block")
        self.second = Block(name="block_1")

    def build(self, input_shape):
        self.first.build(input_shape)
        self.second.build(input_shape)

    def call(self, x):
        return self.second(self.first(x))


@functools.cache
def subclassed_graph() -> AxisGraph:
    """The axis graph of a built `Net` over `(BATCH, TOKENS, WIDTH)` inputs."""
    model = Net(name="net")
    model.build((None, TOKENS, WIDTH))
    traced = trace_model(model, jax.ShapeDtypeStruct((BATCH, TOKENS, WIDTH), "float32"))
    return build_axis_graph(traced.closed_jaxpr, traced.invar_kinds)


def param_class(graph: AxisGraph, path: str, dim: int) -> int:
    return graph.param(path).dim_classes[dim]


def batch_class(graph: AxisGraph) -> int:
    (tokens,) = [t for t in graph.tensors if t.kind == "input"]
    return tokens.dim_classes[0]
