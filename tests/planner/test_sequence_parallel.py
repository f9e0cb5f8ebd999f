"""The sequence-parallel cut of a plan (`planner/sequence_parallel.py`)."""

from keras_autoshard.planner.cost_model import Assignment, MeshAxis
from keras_autoshard.planner.sequence_parallel import (
    TOKEN_DIM,
    describe,
    sequence_cut,
    with_sequence_cut,
)
from tests.planner.small_models import (
    AXES,
    BATCH,
    TOKENS,
    WIDTH,
    batch_class,
    blocks_graph,
    param_class,
)


def _megatron(graph):
    hidden = {param_class(graph, f"{b}/up/kernel", 1) for b in ("block", "block_1")}
    return Assignment({batch_class(graph): "batch", **dict.fromkeys(hidden, "model")})


def test_megatron_blocks_cut_their_residual_stream_along_the_tokens():
    graph = blocks_graph()
    cut = sequence_cut(graph, AXES, _megatron(graph))
    assert cut.axis == "model"
    assert cut.layers == ("block", "block_1")
    assert cut.notes == ()
    stream = (BATCH, TOKENS, WIDTH)
    # Between the parallel regions: one residual-stream tensor per block,
    # cut along the tokens; the down projections' outputs (row-parallel:
    # partial sums reduce-scattered) counted cut, not pinned.
    assert len(cut.cuts) == len(cut.scattered) == 2
    for tensor_id, dims in {**cut.cuts, **cut.scattered}.items():
        assert graph.tensors[tensor_id].shape == stream
        assert dims == ((TOKEN_DIM, "model"),)
    # The second block's input is read by its up projection: held whole.
    assert len(cut.gathered) == 1 and cut.gathered <= set(cut.cuts)
    assert cut.pinned_scopes == (
        "table", "block", "block/up", "block/down",
        "block_1", "block_1/up", "block_1/down",
    )  # fmt: skip
    assert describe(cut, 4).startswith(
        "sequence parallelism over 'model' in 2 layer call(s) (block … block_1)"
    )


def test_the_estimate_counts_gathered_inputs_whole_and_scattered_outputs_cut():
    graph = blocks_graph()
    cut = sequence_cut(graph, AXES, _megatron(graph))
    (gathered,) = cut.gathered
    laid_out = with_sequence_cut(_megatron(graph), cut)
    assert set(laid_out.activation_cuts) == set(cut.cuts) - {gathered}
    held = with_sequence_cut(_megatron(graph), cut, held=True)
    assert set(held.activation_cuts) == (set(cut.cuts) - {gathered}) | set(
        cut.scattered
    )


def test_a_mesh_of_data_axes_only_has_no_axis_for_the_tokens():
    graph = blocks_graph()
    cut = sequence_cut(
        graph,
        (MeshAxis.named("batch", 8),),
        Assignment({batch_class(graph): "batch"}),
    )
    assert cut.axis is None and cut.cuts == {} and cut.layers == ()
    assert cut.notes == (
        "Sequence parallelism not applied: the mesh has no tensor-parallel "
        "axis (every axis of size > 1 is a data axis).",
    )
