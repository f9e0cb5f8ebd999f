"""Trace scopes and Keras layer paths (`graph/layer_paths.py`)."""

from keras_autoshard.graph.layer_paths import (
    keras_layer_path,
    scope_rewrites,
    split_variable_path,
    top_level_scopes,
)
from tests.planner.small_models import blocks_graph, subclassed_graph


def test_a_variable_path_splits_before_its_first_top_level_scope():
    tops = {"block", "block_1"}
    assert split_variable_path("net/block/up/kernel", tops) == (
        "net/",
        "block/up/kernel",
    )
    assert split_variable_path("block_1/up/bias", tops) == ("", "block_1/up/bias")
    assert split_variable_path("other/up/kernel", tops) == ("", "other/up/kernel")


def test_a_functional_models_scopes_are_its_layer_paths():
    graph = blocks_graph()
    assert top_level_scopes(graph) == {"table", "block", "block_1"}
    rewrites = scope_rewrites(graph)
    assert set(rewrites.values()) == {("", "")}
    assert keras_layer_path("block_1/down", rewrites) == "block_1/down"


def test_a_subclassed_models_layer_paths_start_with_its_name():
    graph = subclassed_graph()
    assert top_level_scopes(graph) == {"block", "block_1"}
    rewrites = scope_rewrites(graph)
    assert rewrites == {"block": ("", "net/"), "block_1": ("", "net/")}
    assert keras_layer_path("block/up", rewrites) == "net/block/up"


def test_a_backbone_scope_called_inside_a_task_is_dropped():
    rewrites = {"task": ("task/", "")}
    assert keras_layer_path("task/backbone/layer_0", rewrites) == "backbone/layer_0"
    assert keras_layer_path("head", rewrites) == "head"
