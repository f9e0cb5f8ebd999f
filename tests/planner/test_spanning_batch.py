"""The batch cut over every mesh axis at once (`("batch", "model")`) where a
grouped convolution would otherwise keep it whole.

XLA computes a grouped convolution's filter gradient wrong unless every mesh
axis cuts its input once the batch is cut (`tests/planner/test_grouped_conv.py`). When
the convolution's channels cannot take the other axes, the planner searches
again with an axis spanning the mesh's (`MeshAxis.spanning`): the batch cut
over all of them satisfies the rule and every device computes its own rows.
"""

import jax
import keras
import numpy as np
import pytest

import keras_autoshard as ka
from tests.parity import check_parity, distribute_batch

MESH_2x4 = ka.MeshSpec((2, 4), ("batch", "model"))
EVERY_AXIS = ("batch", "model")


def narrow_depthwise_image_model():
    # 6 channels: the model axis (4) cannot cut the depthwise convolution's.
    inputs = keras.Input((8, 8, 3), name="image")
    hidden = keras.layers.Conv2D(6, 3, padding="same", name="stem")(inputs)
    hidden = keras.layers.DepthwiseConv2D(5, padding="same", name="depthwise")(hidden)
    hidden = keras.layers.Dense(24, activation="gelu", name="up")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D(name="pool")(hidden)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(hidden))


def _batch(shape, outputs, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype("float32")
    return x, rng.standard_normal((shape[0], outputs)).astype("float32")


def _assert_every_device_has_its_own_rows(dist, x):
    (rows,) = jax.tree_util.tree_leaves(distribute_batch(dist, x))
    assert {s.data.shape[0] for s in rows.addressable_shards} == {len(x) // 8}
    assert len({s.index[0].start for s in rows.addressable_shards}) == 8


def test_a_grouped_conv_whose_channels_do_not_divide_cuts_the_batch_over_every_axis():
    x, y = _batch((8, 8, 8, 3), 10)
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    check_parity(narrow_depthwise_image_model, dist, x, y, steps=2)
    plan = dist.plan
    assert plan.batch_axis == EVERY_AXIS, plan.summary()
    assert not [n for n in plan.notes if n.startswith("The batch of")], plan.notes
    (why,) = [n for n in plan.notes if "cut over every mesh axis" in n]
    assert "Input 'input': its batch (8 rows)" in why
    assert "('batch+model'), since cut over 'batch' alone" in why
    assert "grouped convolution in layer 'depthwise'" in why
    assert plan.estimate.communication_by_axis["batch+model"] > 0
    _assert_every_device_has_its_own_rows(dist, x)


@pytest.mark.slow
def test_convnext_tiny_cuts_its_batch_over_every_axis_and_trains_like_one_device():
    # keras.applications.ConvNeXtTiny at 32 px, batch 8 (issue 33's case: its
    # depthwise convolutions kept the batch whole on 2x4).
    def convnext():
        return keras.applications.ConvNeXtTiny(
            weights=None, input_shape=(32, 32, 3), classes=10
        )

    x, y = _batch((8, 32, 32, 3), 10)
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    check_parity(convnext, dist, x, y, steps=2)
    assert dist.plan.batch_axis == EVERY_AXIS, dist.plan.notes
    _assert_every_device_has_its_own_rows(dist, x)


def test_the_spanning_batch_compiles_to_one_gradient_all_reduce_over_every_device():
    # Read off the optimized HLO: the gradients' all-reduce spans both axes,
    # nothing runs over one axis alone, and its operand bytes are the whole
    # model's gradients (float32) and the loss (a float32 scalar), which the
    # estimate's communication over 'batch+model' predicts.
    from keras_autoshard import inspect_compiled
    from keras_autoshard.report.estimate_check import check_train_step

    x, y = _batch((8, 8, 8, 3), 10)
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    with dist.scope():
        model = narrow_depthwise_image_model()
        model.compile(optimizer="adam", loss="mse")
    report = inspect_compiled(model, dist, (x, y), with_forward_step=False)
    step = report.train_step
    assert dist.plan.batch_axis == EVERY_AXIS
    assert step.count("all-reduce", EVERY_AXIS) >= 1
    assert step.operand_bytes(mesh_axes=("batch",)) == 0
    assert step.operand_bytes(mesh_axes=("model",)) == 0
    gradient_bytes = sum(v.total_bytes for v in dist.plan.variables)
    assert step.operand_bytes(mesh_axes=EVERY_AXIS) == gradient_bytes + 4
    estimated = dist.plan.estimate.communication_by_axis["batch+model"]
    assert estimated == gradient_bytes
    (check,) = check_train_step({"communication over batch+model": estimated}, step)
    assert check.compiled_bytes == gradient_bytes + 4 and not check.flagged
