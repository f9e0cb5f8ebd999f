"""Repeated blocks the search ties together (`planner/symmetry.py`)."""

import jax
import keras

from keras_autoshard.graph.builder import build_axis_graph
from keras_autoshard.planner.symmetry import repeated_blocks
from keras_autoshard.trace.tracer import trace_model
from tests.planner.small_models import blocks_graph, subclassed_graph

PARAMS = ["down/bias", "down/kernel", "up/bias", "up/kernel"]


def _names(families):
    return [[[t.name for t in block] for block in family] for family in families]


def test_two_copies_of_a_block_are_one_family_parameter_by_parameter():
    assert _names(repeated_blocks(blocks_graph())) == [
        [[f"block/{p}" for p in PARAMS], [f"block_1/{p}" for p in PARAMS]]
    ]


def test_a_subclassed_models_copies_are_found_under_its_name():
    assert _names(repeated_blocks(subclassed_graph())) == [
        [[f"net/block/{p}" for p in PARAMS], [f"net/block_1/{p}" for p in PARAMS]]
    ]


def test_flat_layers_of_one_shape_are_no_family():
    model = keras.Sequential(
        [
            keras.Input((16,), batch_size=4),
            keras.layers.Dense(16),
            keras.layers.Dense(16),
        ]
    )
    traced = trace_model(model, jax.ShapeDtypeStruct((4, 16), "float32"))
    graph = build_axis_graph(traced.closed_jaxpr, traced.invar_kinds)
    assert len(graph.params()) == 4
    assert repeated_blocks(graph) == []
