"""A rematerialized layer's backward pass gives its weight gradients together
with its input's gradient (`apply/remat.py`): the layer below waits for
them, so an accelerator's scheduler cannot defer them into the layer below's
backward pass with their operands live.

Read off the lowered train step (XLA:CPU drops optimization barriers before
scheduling, so its compiled program cannot show them): each rematerialized
layer has a barrier on the inputs of its recomputation (`jax.checkpoint`'s)
and one whose operands are the gradients of its input and its variables.
"""

import re

import keras
import numpy as np

from keras_autoshard import rematerialize
from keras_autoshard.report.compiled_program import train_step_program

# `%5:3 = stablehlo.optimization_barrier %a, %b, %c : tensor<..>, tensor<..>`
_BARRIER = re.compile(r"stablehlo\.optimization_barrier [^:\n]*: ([^\n]*)")


class _Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(48, activation="gelu")
        self.down = keras.layers.Dense(16)

    def call(self, x):
        return x + self.down(self.up(x))


def _model():
    inputs = keras.Input((12, 16))
    x = inputs
    for index in range(3):
        x = _Block(name=f"block_{index}")(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


def _barrier_operand_types(rematerialized: list[str]) -> list[list[str]]:
    distribution = keras.distribution.DataParallel()
    with distribution.scope():
        model = _model()
        model.compile(optimizer="adam", loss="mse")
    rematerialize(model, rematerialized)
    x = np.zeros((8, 12, 16), "float32")
    y = np.zeros((8, 12, 4), "float32")
    step, arguments = train_step_program(model, distribution, (x, y))
    text = step.lower(*arguments).as_text()
    return [re.findall(r"tensor<([^>]*)>", types) for types in _BARRIER.findall(text)]


def test_each_rematerialized_layer_ties_its_weight_and_input_gradients():
    barriers = _barrier_operand_types(["block_0", "block_1", "block_2"])
    # The gradients of a block's input and of its four variables (up and
    # down kernels and biases), in one barrier, once per block (global
    # shapes: the lowered program is not partitioned yet).
    every_gradient = ["8x12x16xf32", "16x48xf32", "48xf32", "48x16xf32", "16xf32"]
    assert barriers.count(every_gradient) == 3, barriers
    # Besides, jax.checkpoint's own barrier on each recomputation's inputs.
    assert len(barriers) == 2 * 3, barriers


def test_a_layer_that_is_not_rematerialized_has_no_barrier():
    assert _barrier_operand_types([]) == []
