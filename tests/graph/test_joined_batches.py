"""Batches that meet by concatenation stay split.

A model that concatenates two batches along the batch (two views of one batch,
as contrastive models do; real and generated images before a GAN's
discriminator) used to keep its batch whole: the concatenated dim was marked
unshardable. Parts of equal size and their join may now be cut over the same
axis (`SliceEdge.joined`): XLA moves each device's rows of the join from the
devices that hold them (collective permutes and all-to-alls), which the cost
model counts as the parts' bytes, forward and backward.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_autoshard as ka
from tests.parity import check_parity

MESHES = {
    "2x4": (ka.MeshSpec((2, 4), ("batch", "model")), "batch"),
    "8x1": (ka.MeshSpec((8, 1), ("batch", "model")), "batch"),
    "1x8": (ka.MeshSpec((1, 8), ("batch", "model")), "model"),
}


class TwoViews(keras.Model):
    """Two views of each row, concatenated along the batch, one encoder."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.view_a = keras.layers.Dense(16, name="view_a")
        self.view_b = keras.layers.Dense(16, name="view_b")
        self.encoder = keras.layers.Dense(32, activation="relu", name="encoder")
        self.head = keras.layers.Dense(8, name="head")

    def build(self, input_shape):
        self.view_a.build(input_shape)
        self.view_b.build(input_shape)
        self.encoder.build((None, 16))
        self.head.build((None, 32))

    def call(self, rows):
        both = ops.concatenate([self.view_a(rows), self.view_b(rows)], axis=0)
        return self.head(self.encoder(both))


def two_views():
    model = TwoViews(name="two_views")
    model.build((None, 12))
    return model


def _batch(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 12)).astype("float32")
    return x, rng.standard_normal((2 * rows, 8)).astype("float32")


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_two_views_concatenated_along_the_batch_keep_it_split(mesh_name):
    mesh, batch_axis = MESHES[mesh_name]
    x, y = _batch()
    dist = ka.AutoShardDistribution(device_mesh=mesh)
    check_parity(two_views, dist, x, y, steps=2)
    plan = dist.plan
    assert plan.batch_axis == batch_axis, plan.summary()
    assert not [n for n in plan.notes if "concatenate" in n], plan.notes


def test_the_rows_moved_for_the_join_are_counted_and_compiled():
    # Read off the optimized HLO on 8x1: besides the gradients' all-reduce,
    # XLA moves rows for the join (collective permutes and all-to-alls over
    # 'batch'); the estimate counts each part's rows once forward and once
    # backward (2 parts x 2 rows x 16 floats x 2 = 512 B). Measured: the
    # compiled step moves 1152 B for it (a permute of the join, three of the
    # parts' gradients and three all-to-alls of the loss's gradient), which
    # the estimate under-counts; both are far below gathering the batch.
    from keras_autoshard import inspect_compiled

    mesh, _ = MESHES["8x1"]
    x, y = _batch()
    dist = ka.AutoShardDistribution(device_mesh=mesh)
    with dist.scope():
        model = two_views()
        model.compile(optimizer="adam", loss="mse")
    step = inspect_compiled(model, dist, (x, y), with_forward_step=False).train_step
    gradient_bytes = sum(v.total_bytes for v in dist.plan.variables)
    moved = step.operand_bytes(kind="collective-permute") + step.operand_bytes(
        kind="all-to-all"
    )
    assert moved > 0
    assert step.operand_bytes(kind="all-reduce") == gradient_bytes + 4
    estimated = dist.plan.estimate.communication_by_axis["batch"]
    assert estimated == gradient_bytes + 2 * 2 * 2 * 16 * 4
    assert moved < x.nbytes + y.nbytes
