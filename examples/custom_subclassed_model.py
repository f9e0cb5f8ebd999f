"""Shard a custom subclassed Keras model automatically.

The planner reads the model's computation graph, so a model written from
scratch needs no annotations: here, a small subclassed transformer-style
block stack (attention written with `keras.ops`, a gated MLP) is trained
under `AutoShardDistribution`, which plans on the first batch and re-lays
the variables out onto the plan. The sharded losses are compared with the
same model trained on one device from the same weights.

    python examples/custom_subclassed_model.py
    python examples/custom_subclassed_model.py --hidden 256 --blocks 4 --mesh 1x8
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_autoshard as ka  # noqa: E402

ka.simulate_devices(8)  # before JAX starts; a no-op with accelerators

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402


class Block(keras.layers.Layer):
    """Self-attention with hand-written heads, then a gated MLP."""

    def __init__(self, hidden: int, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.heads = hidden, heads
        self.norm_1 = keras.layers.LayerNormalization(name="norm_1")
        self.query = keras.layers.Dense(hidden, use_bias=False, name="query")
        self.key = keras.layers.Dense(hidden, use_bias=False, name="key")
        self.value = keras.layers.Dense(hidden, use_bias=False, name="value")
        self.out = keras.layers.Dense(hidden, use_bias=False, name="out")
        self.norm_2 = keras.layers.LayerNormalization(name="norm_2")
        self.gate = keras.layers.Dense(4 * hidden, activation="gelu", name="gate")
        self.up = keras.layers.Dense(4 * hidden, name="up")
        self.down = keras.layers.Dense(hidden, name="down")

    def build(self, input_shape):
        # Variables are created here, before any data flows, so that the
        # planner and the distribution see them all.
        wide = (*input_shape[:-1], 4 * self.hidden)
        for layer in (self.norm_1, self.query, self.key, self.value, self.out):
            layer.build(input_shape)
        for layer in (self.norm_2, self.gate, self.up):
            layer.build(input_shape)
        self.down.build(wide)

    def call(self, x):
        batch, seq = ops.shape(x)[0], ops.shape(x)[1]
        head_dim = self.hidden // self.heads
        normed = self.norm_1(x)
        q, k, v = (
            ops.reshape(project(normed), (batch, seq, self.heads, head_dim))
            for project in (self.query, self.key, self.value)
        )
        scores = ops.einsum("bqhd,bkhd->bhqk", q, k) / float(head_dim) ** 0.5
        attended = ops.einsum("bhqk,bkhd->bqhd", ops.softmax(scores, axis=-1), v)
        x = x + self.out(ops.reshape(attended, (batch, seq, self.hidden)))
        normed = self.norm_2(x)
        return x + self.down(self.gate(normed) * self.up(normed))


class TinyTransformer(keras.Model):
    """Blocks over an input projection, with a regression head."""

    def __init__(self, hidden: int, heads: int, blocks: int, **kwargs):
        super().__init__(**kwargs)
        self.project = keras.layers.Dense(hidden, name="project")
        self.blocks = [Block(hidden, heads, name=f"block_{i}") for i in range(blocks)]
        self.head = keras.layers.Dense(1, name="head")

    def build(self, input_shape):
        self.project.build(input_shape)
        hidden_shape = (*input_shape[:-1], self.project.units)
        for block in self.blocks:
            block.build(hidden_shape)
        self.head.build(hidden_shape)

    def call(self, x):
        x = self.project(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mesh", default="2x4", help="data x model, e.g. 2x4")
    return parser.parse_args()


def build(args) -> TinyTransformer:
    model = TinyTransformer(args.hidden, args.heads, args.blocks, name="tiny")
    model.build((None, args.seq_len, args.features))
    return model


def main() -> None:
    args = parse_args()
    data_size, model_size = (int(s) for s in args.mesh.split("x"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.seq_len, args.features))
    x = x.astype("float32")
    y = rng.standard_normal((args.batch, args.seq_len, 1)).astype("float32")

    keras.utils.set_random_seed(0)
    with ka.building.names_replayed_after():  # the sharded build gets the same paths
        reference = build(args)
    reference.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")

    mesh = ka.MeshSpec((data_size, model_size), ("batch", "model"))
    distribution = ka.AutoShardDistribution(device_mesh=mesh)
    with distribution.scope():
        model = build(args)
        model.set_weights(reference.get_weights())
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        sharded = [float(model.train_on_batch(x, y)) for _ in range(args.steps)]
    single = [float(reference.train_on_batch(x, y)) for _ in range(args.steps)]

    print(distribution.plan.explain())
    worst = max(abs(a - b) / abs(b) for a, b in zip(sharded, single))
    print(f"single-device losses: {', '.join(f'{v:.5f}' for v in single)}")
    print(f"sharded losses:       {', '.join(f'{v:.5f}' for v in sharded)}")
    print(
        f"Trained the subclassed model on mesh {distribution.plan.mesh.describe()}: "
        f"worst relative loss difference {worst:.1e}"
    )


if __name__ == "__main__":
    main()
