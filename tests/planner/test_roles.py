"""The logical role of each axis class, read from the graph's structure
(`planner/roles.py`)."""

from keras_autoshard.planner.roles import class_roles
from tests.planner.small_models import batch_class, blocks_graph, param_class


def test_roles_of_an_embedding_and_two_mlp_blocks():
    graph = blocks_graph()
    assert class_roles(graph) == {
        batch_class(graph): "examples",
        param_class(graph, "table/embeddings", 0): "vocab",
        param_class(graph, "table/embeddings", 1): "embed",
        param_class(graph, "block/up/kernel", 1): "mlp",
        param_class(graph, "block_1/up/kernel", 1): "mlp",
    }
