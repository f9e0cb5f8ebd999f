"""The layer outputs a plan pins (`planner/output_layouts.py`)."""

from keras_autoshard.planner.cost_model import Assignment
from keras_autoshard.planner.output_layouts import output_layouts, storage_cut_layouts
from keras_autoshard.planner.sequence_parallel import sequence_cut
from tests.planner.small_models import AXES, batch_class, blocks_graph, param_class


def _megatron(graph):
    hidden = {param_class(graph, f"{b}/up/kernel", 1) for b in ("block", "block_1")}
    return Assignment({batch_class(graph): "batch", **dict.fromkeys(hidden, "model")})


def test_a_plain_plan_pins_no_layer_output():
    graph = blocks_graph()
    assert output_layouts(graph, _megatron(graph), {}) == ((), [])


def test_a_layer_whose_kernel_is_cut_for_storage_only_has_its_output_pinned():
    graph = blocks_graph()
    stored = Assignment(
        {batch_class(graph): "batch"}, fsdp={"block/up/kernel": ((1, "batch"),)}
    )
    # Laid out as computed (the batch cut), not as the kernel is stored.
    assert storage_cut_layouts(graph, stored, {}) == {
        "block/up/output": ("batch", None, None)
    }


def test_sequence_parallelism_pins_every_sub_layer_of_the_blocks_and_their_feed():
    graph = blocks_graph()
    megatron = _megatron(graph)
    cut = sequence_cut(graph, AXES, megatron)
    layouts, notes = output_layouts(graph, megatron, {}, cut)
    assert {layout.path: layout.spec for layout in layouts} == {
        "table/output": ("batch", None, None),
        "block/output": ("batch", "model", None),
        "block/up/output": ("batch", None, "model"),
        "block/down/output": ("batch", None, None),
        "block_1/output": ("batch", "model", None),
        "block_1/up/output": ("batch", None, "model"),
        "block_1/down/output": ("batch", None, None),
    }
    assert notes == [
        "Sequence parallelism over 'model' in 2 layer call(s): 7 layer outputs "
        "pinned (the token dim cut between tensor-parallel regions, each "
        "region's own layouts inside)."
    ]
