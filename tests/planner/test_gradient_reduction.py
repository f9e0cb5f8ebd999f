"""The gradients' reduction over the batch (`planner/gradient_reduction.py`)."""

from keras_autoshard.planner.cost_model import Assignment
from keras_autoshard.planner.gradient_reduction import (
    gathered_weight_bytes,
    reduce_scattered,
    reduced_partials,
)
from tests.planner.small_models import SIZES, batch_class, blocks_graph, param_class

PARAMETER_BYTES = 4 * (50 * 16 + 2 * (16 * 64 + 64 + 64 * 16 + 16))


def _megatron(graph):
    hidden = {param_class(graph, f"{b}/up/kernel", 1) for b in ("block", "block_1")}
    return {batch_class(graph): "batch", **dict.fromkeys(hidden, "model")}


def test_the_batch_axis_reduces_every_gradient_as_held_on_a_device():
    graph = blocks_graph()
    data_parallel = Assignment(class_axis={batch_class(graph): "batch"})
    assert reduced_partials(graph, data_parallel, SIZES) == (PARAMETER_BYTES,) * 2
    # Megatron: the hidden dims' parameters are held a quarter on a device.
    held = PARAMETER_BYTES - 3 * 4 * 2 * (16 * 64 + 64 + 64 * 16) // 4
    assert reduced_partials(graph, Assignment(_megatron(graph)), SIZES) == (held,) * 2
    assert reduced_partials(graph, Assignment(class_axis={}), SIZES) == (0, 0)


def test_a_weight_stored_cut_over_the_batch_axis_is_reduce_scattered_not_counted():
    graph = blocks_graph()
    stored = Assignment(
        class_axis={batch_class(graph): "batch"},
        fsdp={"table/embeddings": ((1, "batch"),)},
    )
    partials, _ = reduced_partials(graph, stored, SIZES)
    assert partials == PARAMETER_BYTES - 50 * 16 * 4


def test_only_a_storage_cut_over_a_batch_axis_reduce_scatters_the_gradient():
    graph = blocks_graph()
    table = next(t for t in graph.tensors if t.name == "table/embeddings")
    batch = {batch_class(graph): "batch"}
    over_batch = Assignment(batch, fsdp={"table/embeddings": ((1, "batch"),)})
    over_model = Assignment(batch, fsdp={"table/embeddings": ((1, "model"),)})
    assert reduce_scattered(table, over_batch, {"batch"})
    assert not reduce_scattered(table, over_model, {"batch"})
    assert not reduce_scattered(table, Assignment(batch), {"batch"})


def test_a_gathered_weight_adds_its_copy_and_its_gradient_less_the_shard():
    graph = blocks_graph()
    batch = {batch_class(graph): "batch"}
    table = Assignment(batch, fsdp={"table/embeddings": ((1, "batch"),)})
    # 3200 bytes whole, 1600 stored: the gathered copy and the gradient.
    assert gathered_weight_bytes(graph, table, SIZES) == 2 * 1600
    # The backward pass keeps the up kernel's gathered copy anyway (the
    # input gradient reads it): only its gradient is added.
    kernel = Assignment(batch, fsdp={"block/up/kernel": ((1, "batch"),)})
    assert gathered_weight_bytes(graph, kernel, SIZES) == 16 * 64 * 4 / 2
