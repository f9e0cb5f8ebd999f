"""Small models shared by the tests, built from config (no downloads)."""

import keras
import numpy as np

HIDDEN = 64
SEQ = 16
BATCH = 8


def build_mlp_block(hidden: int = HIDDEN, seq: int = SEQ) -> keras.Model:
    """LayerNorm → column Dense(4h) → row Dense(h) → residual: one Megatron MLP."""
    inputs = keras.Input((seq, hidden), name="x")
    normed = keras.layers.LayerNormalization(name="norm")(inputs)
    up = keras.layers.Dense(4 * hidden, activation="tanh", name="up")(normed)
    down = keras.layers.Dense(hidden, name="down")(up)
    outputs = keras.layers.Add(name="residual")([inputs, down])
    return keras.Model(inputs, outputs, name="mlp_block")


def mlp_batch(hidden: int = HIDDEN, seq: int = SEQ, batch: int = BATCH, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq, hidden)).astype("float32")
    y = rng.standard_normal((batch, seq, hidden)).astype("float32")
    return x, y


GPT2_CONFIG = dict(
    vocabulary_size=1024,
    num_layers=4,
    num_heads=8,
    hidden_dim=256,
    intermediate_dim=1024,
    max_sequence_length=64,
)


def build_gpt2(**overrides) -> keras.Model:
    import keras_hub

    return keras_hub.models.GPT2Backbone(**{**GPT2_CONFIG, **overrides})


def gpt2_batch(batch: int = BATCH, seq: int = 32, hidden: int = 256, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(
            0, GPT2_CONFIG["vocabulary_size"], (batch, seq)
        ).astype("int32"),
        "padding_mask": np.ones((batch, seq), "int32"),
    }
    y = rng.standard_normal((batch, seq, hidden)).astype("float32")
    return x, y
