"""The model zoo of the tests and the benchmarks, every model built from a
config in code (no downloads).

- `ZOO`: the planner's acceptance models (KerasHub GPT-2, BERT, OPT, Gemma,
  Llama backbones from small configs, a functional MLP, a Sequential CNN, a
  subclassed attention model, a model with tied embeddings), each with its
  batch; `random_targets` for regression targets of any output structure.
- `build_mlp_block` / `mlp_batch`: one Megatron MLP block (LayerNorm, column
  then row Dense, residual) at any width.
- `build_gpt2` / `gpt2_batch`: a KerasHub GPT-2 backbone; `SMALL_GPT2_CONFIG`
  for the tests, `BENCHMARK_GPT2_CONFIG` for the benchmarks.
"""

import keras
import numpy as np
from keras import ops

BATCH, SEQ = 8, 64


def token_inputs(vocab, batch=BATCH, seq=SEQ, segments=False, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(0, vocab, (batch, seq)).astype("int32"),
        "padding_mask": np.ones((batch, seq), "int32"),
    }
    if segments:
        x["segment_ids"] = np.zeros((batch, seq), "int32")
    return x


def gpt2():
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=1024,
        num_layers=2,
        num_heads=8,
        hidden_dim=256,
        intermediate_dim=1024,
        max_sequence_length=SEQ,
    )


def bert():
    import keras_hub

    return keras_hub.models.BertBackbone(
        vocabulary_size=1024,
        num_layers=2,
        num_heads=8,
        hidden_dim=256,
        intermediate_dim=512,
        max_sequence_length=SEQ,
    )


def opt():
    import keras_hub

    # A vocabulary no mesh axis of size 4 or 8 divides.
    return keras_hub.models.OPTBackbone(
        vocabulary_size=1003,
        num_layers=2,
        num_heads=8,
        hidden_dim=256,
        intermediate_dim=512,
        max_sequence_length=SEQ,
    )


def gemma():
    import keras_hub

    return keras_hub.models.GemmaBackbone(
        vocabulary_size=1024,
        num_layers=2,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=256,
        intermediate_dim=1024,
        head_dim=32,
    )


def llama():
    import keras_hub

    return keras_hub.models.LlamaBackbone(
        vocabulary_size=1024,
        num_layers=2,
        num_query_heads=8,
        num_key_value_heads=2,
        hidden_dim=256,
        intermediate_dim=512,
    )


def mlp():
    inputs = keras.Input((SEQ, 128), name="features")
    h = keras.layers.Dense(512, activation="gelu", name="mlp_up")(inputs)
    h = keras.layers.Dense(128, name="mlp_down")(h)
    outputs = keras.layers.Dense(16, name="head")(h)
    return keras.Model(inputs, outputs)


def cnn():
    return keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


class SelfAttentionBlock(keras.layers.Layer):
    """Attention written with plain ops: heads come from reshapes."""

    def __init__(self, hidden, heads, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.heads = hidden, heads
        self.q = keras.layers.Dense(hidden)
        self.k = keras.layers.Dense(hidden)
        self.v = keras.layers.Dense(hidden)
        self.out = keras.layers.Dense(hidden)
        self.up = keras.layers.Dense(4 * hidden, activation="relu")
        self.down = keras.layers.Dense(hidden)
        self.norm1 = keras.layers.LayerNormalization()
        self.norm2 = keras.layers.LayerNormalization()

    def build(self, input_shape):
        for layer in (self.q, self.k, self.v, self.out, self.up):
            layer.build(input_shape)
        self.down.build(tuple(input_shape[:-1]) + (4 * self.hidden,))
        self.norm1.build(input_shape)
        self.norm2.build(input_shape)

    def call(self, x):
        batch, seq = ops.shape(x)[0], ops.shape(x)[1]
        head_dim = self.hidden // self.heads
        normed = self.norm1(x)

        def split_heads(t):
            return ops.reshape(t, (batch, seq, self.heads, head_dim))

        q, k, v = (split_heads(f(normed)) for f in (self.q, self.k, self.v))
        scores = ops.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
        context = ops.einsum("bhqk,bkhd->bqhd", ops.softmax(scores, axis=-1), v)
        x = x + self.out(ops.reshape(context, (batch, seq, self.hidden)))
        return x + self.down(self.up(self.norm2(x)))


class Subclassed(keras.Model):
    def __init__(self, hidden=128, heads=8, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [SelfAttentionBlock(hidden, heads) for _ in range(2)]
        self.head = keras.layers.Dense(8)

    def build(self, input_shape):
        for block in self.blocks:
            block.build(input_shape)
        self.head.build(input_shape)

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def subclassed():
    model = Subclassed()
    model.build((None, SEQ, 128))
    return model


class TiedLM(keras.Model):
    """Token embedding used twice: lookup in, transposed projection out."""

    def __init__(self, vocab=1024, hidden=128, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(vocab, hidden, name="embedding")
        self.mix = keras.layers.Dense(hidden, activation="tanh", name="mix")

    def build(self, input_shape):
        self.embedding.build(input_shape)
        self.mix.build(tuple(input_shape) + (self.embedding.output_dim,))

    def call(self, token_ids):
        h = self.mix(self.embedding(token_ids))
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


def tied():
    model = TiedLM()
    model.build((None, SEQ))
    return model


def dense_inputs(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


# name → (builder, batch of inputs)
ZOO = {
    "gpt2": (gpt2, lambda: token_inputs(1024)),
    "bert": (bert, lambda: token_inputs(1024, segments=True)),
    "opt": (opt, lambda: token_inputs(1003)),
    "gemma": (gemma, lambda: token_inputs(1024)),
    "llama": (llama, lambda: token_inputs(1024)),
    "mlp": (mlp, lambda: dense_inputs((BATCH, SEQ, 128))),
    "cnn": (cnn, lambda: dense_inputs((BATCH, 16, 16, 3))),
    "subclassed": (subclassed, lambda: dense_inputs((BATCH, SEQ, 128))),
    "tied": (
        tied,
        lambda: (
            np.random.default_rng(0).integers(0, 1024, (BATCH, SEQ)).astype("int32")
        ),
    ),
}


def random_targets(build, x, seed=1):
    """Random regression targets shaped like the model's outputs (any tree)."""
    import jax

    from keras_autoshard.trace.tracer import build_abstract, shape_structs

    model = build_abstract(build)
    trainable = shape_structs([v for v in model.trainable_variables])
    non_trainable = shape_structs([v for v in model.non_trainable_variables])

    def forward(tv, ntv, inputs):
        return model.stateless_call(tv, ntv, inputs)[0]

    spec = jax.eval_shape(forward, trainable, non_trainable, shape_structs(x))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: rng.standard_normal(tuple(s.shape)).astype("float32"), spec
    )


# ------------------------------------------------ MLP block and GPT-2
HIDDEN = 64
MLP_SEQ = 16


def build_mlp_block(hidden: int = HIDDEN, seq: int = MLP_SEQ) -> keras.Model:
    """LayerNorm → column Dense(4h) → row Dense(h) → residual: one Megatron MLP."""
    inputs = keras.Input((seq, hidden), name="x")
    normed = keras.layers.LayerNormalization(name="norm")(inputs)
    up = keras.layers.Dense(4 * hidden, activation="tanh", name="up")(normed)
    down = keras.layers.Dense(hidden, name="down")(up)
    outputs = keras.layers.Add(name="residual")([inputs, down])
    return keras.Model(inputs, outputs, name="mlp_block")


def mlp_batch(hidden: int = HIDDEN, seq: int = MLP_SEQ, batch: int = BATCH, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq, hidden)).astype("float32")
    y = rng.standard_normal((batch, seq, hidden)).astype("float32")
    return x, y


SMALL_GPT2_CONFIG = dict(
    vocabulary_size=1024,
    num_layers=4,
    num_heads=8,
    hidden_dim=256,
    intermediate_dim=1024,
    max_sequence_length=64,
)


def build_gpt2(**overrides) -> keras.Model:
    """A KerasHub GPT-2 backbone: `SMALL_GPT2_CONFIG` with `overrides`."""
    import keras_hub

    return keras_hub.models.GPT2Backbone(**{**SMALL_GPT2_CONFIG, **overrides})


def gpt2_batch(batch: int = BATCH, seq: int = 32, hidden: int = 256, seed=0):
    """Random token ids (of `SMALL_GPT2_CONFIG`'s vocabulary), a full padding
    mask and random hidden-state targets."""
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(
            0, SMALL_GPT2_CONFIG["vocabulary_size"], (batch, seq)
        ).astype("int32"),
        "padding_mask": np.ones((batch, seq), "int32"),
    }
    y = rng.standard_normal((batch, seq, hidden)).astype("float32")
    return x, y


# The benchmarks' GPT-2 (`benchmarks/models.py`).
BENCHMARK_GPT2_CONFIG = dict(
    vocabulary_size=8192,
    num_layers=4,
    num_heads=8,
    hidden_dim=512,
    intermediate_dim=2048,
    max_sequence_length=128,
)
