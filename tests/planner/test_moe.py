"""Mixture-of-experts layers: expert parallelism where the experts divide the
mesh axis, tensor parallelism inside the experts otherwise, parity with one
device either way. The MoE block is written here (stacked expert kernels,
top-k routing computed densely, as KerasHub's MoE backbones do)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_autoshard as ka
from tests.parity import check_parity

MESH_2x4 = ka.MeshSpec((2, 4), ("batch", "model"))


class StackedExperts(keras.layers.Layer):
    """`num_experts` gated MLPs as stacked kernels, routed top-k."""

    def __init__(self, num_experts, hidden, inner, top_k=2, **kwargs):
        super().__init__(**kwargs)
        self.num_experts, self.hidden, self.inner, self.top_k = (
            num_experts,
            hidden,
            inner,
            top_k,
        )
        self.router = keras.layers.Dense(num_experts, use_bias=False, name="router")

    def build(self, input_shape):
        self.router.build((None, self.hidden))
        shape_in = (self.num_experts, self.hidden, self.inner)
        self.gate = self.add_weight(shape=shape_in, name="gate")
        self.up = self.add_weight(shape=shape_in, name="up")
        self.down = self.add_weight(
            shape=(self.num_experts, self.inner, self.hidden), name="down"
        )

    def call(self, x):
        _, seq, hidden = x.shape
        tokens = ops.reshape(x, (-1, hidden))
        probabilities = ops.softmax(self.router(tokens), axis=-1)
        top_p, top_i = ops.top_k(probabilities, k=self.top_k)
        top_p = top_p / ops.sum(top_p, axis=-1, keepdims=True)
        routing = ops.sum(
            ops.one_hot(top_i, self.num_experts) * top_p[..., None], axis=1
        )
        gate = ops.silu(ops.einsum("th,ehm->etm", tokens, self.gate))
        inner = gate * ops.einsum("th,ehm->etm", tokens, self.up)
        out = ops.einsum("etm,emh->eth", inner, self.down)
        mixed = ops.sum(out * ops.transpose(routing)[:, :, None], axis=0)
        return ops.reshape(mixed, (-1, seq, hidden))


def moe_model(num_experts):
    def build():
        inputs = keras.Input((8, 32), name="features")
        hidden = keras.layers.Dense(32, name="embed")(inputs)
        hidden = hidden + StackedExperts(num_experts, 32, 64, name="moe")(hidden)
        return keras.Model(inputs, keras.layers.Dense(16, name="head")(hidden))

    return build


def _batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 8, 32)).astype("float32")
    y = rng.standard_normal((8, 8, 16)).astype("float32")
    return x, y


def test_experts_that_divide_the_model_axis_are_cut_over_it_with_parity():
    x, y = _batch()
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    check_parity(moe_model(8), dist, x, y, steps=5)
    plan = dist.plan
    for name in ("gate", "up", "down"):
        entry = plan.variable(f"moe/{name}")
        assert entry.spec[0] == "model" and entry.roles[0] == "experts", entry
    assert any(n.startswith("Expert parallelism: 8 experts") for n in plan.notes)
    assert plan.batch_axis == "batch"


def test_experts_that_do_not_divide_are_kept_whole_and_cut_inside():
    x, y = _batch()
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    check_parity(moe_model(6), dist, x, y, steps=2)
    plan = dist.plan
    gate = plan.variable("moe/gate")
    assert gate.spec[0] is None and "model" in gate.spec, gate
    note = [n for n in plan.notes if "experts are kept whole" in n]
    assert note and "6 experts do not divide 'model' (size 4)" in note[0]


@pytest.mark.parametrize("mesh", [ka.MeshSpec((8, 1), ("batch", "model"))], ids=str)
def test_moe_token_flattening_keeps_data_parallelism_on_a_data_only_mesh(mesh):
    x, _ = _batch()
    plan = ka.plan(moe_model(8), mesh, sample_input=x)
    assert plan.batch_axis == "batch"
