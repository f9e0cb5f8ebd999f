"""`lever_options`: what each memory lever offers, in the order tried."""

import pytest

from keras_autoshard.planner.lever_options import (
    accumulation_options,
    remat_options,
    rows_per_data_rank,
    sequence_parallel_modes,
)
from tests.planner.tiny_graph import axes, dense_graph


def test_sequence_parallel_requests_become_the_modes_tried():
    assert sequence_parallel_modes(False, "train") == (False,)
    assert sequence_parallel_modes(True, "train") == (True,)
    assert sequence_parallel_modes("auto", "train") == (False, True)
    with pytest.raises(ValueError, match="sequence_parallel=None: use one of"):
        sequence_parallel_modes(None, "train")


def test_micro_batch_counts_are_powers_of_two_dividing_a_ranks_batch():
    graph = dense_graph()
    # A batch of 8 over the data axis of 2: 4 rows per data-parallel rank.
    assert rows_per_data_rank(graph, axes()) == 4
    assert accumulation_options(graph, axes(), "train") == [2, 4]
    assert accumulation_options(graph, axes(), "inference") == []


def test_without_repeated_layers_the_only_remat_option_is_none():
    assert remat_options(dense_graph(), "train") == [()]
    assert remat_options(dense_graph(), "generate", "all") == [()]
