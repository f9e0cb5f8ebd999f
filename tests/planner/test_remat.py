"""Which layer calls the backward pass recomputes, and what a device keeps
then (`planner/remat.py`)."""

from keras_autoshard.planner.remat import kept_terms, layer_calls, remat_families
from tests.planner.small_models import BATCH, HIDDEN, TOKENS, WIDTH, blocks_graph

STREAM_BYTES = BATCH * TOKENS * WIDTH * 4  # a block's input, float32
HIDDEN_BYTES = BATCH * TOKENS * HIDDEN * 4  # its ReLU's output


def _bytes(graph, terms):
    return sum(graph.tensors[tid].nbytes * factor for tid, factor in terms)


def test_layer_calls_in_call_order_and_the_blocks_as_one_family():
    graph = blocks_graph()
    assert layer_calls(graph) == ["table", "block", "block_1"]
    assert remat_families(graph) == [("block", "block_1")]


def test_rematerializing_both_blocks_keeps_their_inputs_and_one_blocks_residuals():
    graph = blocks_graph()
    # Each block keeps its ReLU's output (the down projection's kernel
    # gradient reads it) and its mask (a byte per float: 0.25), and its
    # input (the up projection's); the table's output is the first input.
    relu = HIDDEN_BYTES * 1.25
    assert _bytes(graph, kept_terms(graph, frozenset())) == 2 * STREAM_BYTES + 2 * relu
    # Rematerialized: the inputs stay, one block's residuals are made again
    # while its backward pass runs.
    remat = frozenset({"block", "block_1"})
    assert _bytes(graph, kept_terms(graph, remat)) == 2 * STREAM_BYTES + relu
