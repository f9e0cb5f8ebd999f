"""`step_flops`: a training step's contraction FLOPs on one device."""

from keras_autoshard.planner.cost_model import Assignment
from keras_autoshard.planner.step_flops import compute_flops_per_device
from tests.planner.tiny_graph import BATCH, FEATURES, OUTPUTS, axes, dense_graph

PRODUCT = 2 * BATCH * FEATURES * OUTPUTS


def test_forward_and_backward_products_split_by_the_axes_cutting_them():
    whole = Assignment(class_axis={})
    assert compute_flops_per_device(dense_graph(), axes(), whole) == (
        3 * PRODUCT,
        0.0,
    )
    cut = Assignment(class_axis={0: "batch", 2: "model"})
    assert compute_flops_per_device(dense_graph(), axes(), cut) == (
        3 * PRODUCT / 8,
        0.0,
    )


def test_a_rematerialized_layer_adds_its_forward_product_again():
    whole = Assignment(class_axis={})
    total, recomputed = compute_flops_per_device(
        dense_graph(), axes(), whole, frozenset({"dense"})
    )
    assert (total, recomputed) == (4 * PRODUCT, PRODUCT)
