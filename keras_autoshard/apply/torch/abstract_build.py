"""Build a Keras model on the PyTorch backend without allocating its weights.

`build_abstract` runs a builder (a function, a Keras config, or a KerasHub
preset directory) under Keras's own deferred-initialisation seam: inside a
`StatelessScope(initialize_variables=False)` every variable is created with
its shape, dtype and initializer but no value, and anything Keras evaluates
while building (symbolic calls) runs on torch's `meta` device, which holds
no data. The planner needs only these shapes; `sharded_state` then gives
each variable this rank's block and nothing more (`materialise_local`).

Initial values, when no weights file fills them: each variable's initializer
runs for the whole shape, one variable at a time, with Python's and torch's
generators seeded from `(seed, variable index)` and restored afterwards, so
every rank computes the same tensor and keeps its block. A rank therefore
holds its shards plus, briefly, the largest single variable.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Mapping
from typing import Any

import keras

from keras_autoshard.compat import keras_variables
from keras_autoshard.errors import TensorParallelError

PRESET_CONFIG_FILE = "config.json"
PRESET_WEIGHTS_FILE = "model.weights.h5"


def is_abstract_source(source: Any) -> bool:
    """Whether `TensorParallel` should build `source` without weights: a
    function, a Keras config dict, or a preset directory (not a model)."""
    if isinstance(source, keras.Model):
        return False
    return callable(source) or isinstance(source, (Mapping, str, os.PathLike))


def build_abstract(source) -> tuple[keras.Model, str | None]:
    """Build the model `source` describes with no variable allocated.

    Args:
        source: A function returning a Keras model (it must build from a
            configuration, not load weights: pass the weights file to
            `TensorParallel(weights=...)`), a Keras config dict
            (`keras.saving.serialize_keras_object(model)`), or a KerasHub
            preset directory holding `config.json` (and usually
            `model.weights.h5`).

    Returns:
        The model, its variables not initialised, and the preset's weights
        file when `source` is a preset directory that has one (else `None`).

    Raises:
        TensorParallelError: `source` is none of those, the builder
            returned no model, or it assigned values while building (it
            loaded weights, which would be lost).

    Example:

    ```python
    model, weights = build_abstract("./llama_preset")
    [v.path for v in model.variables if not is_materialised(v)]  # all
    ```
    """
    weights = None
    if isinstance(source, (str, os.PathLike)):
        source, weights = _preset_source(os.fspath(source))
    with (
        keras.device("meta"),
        keras.StatelessScope(initialize_variables=False) as scope,
    ):
        if isinstance(source, Mapping):
            model = keras.saving.deserialize_keras_object(dict(source))
        else:
            model = source()
    if not isinstance(model, keras.Model):
        raise TensorParallelError(
            f"The builder returned {type(model).__name__}, not a keras.Model."
        )
    assigned = [
        v.path for v in model.variables if scope.get_current_value(v) is not None
    ]
    if assigned:
        raise TensorParallelError(
            f"The builder assigned {len(assigned)} variables while building "
            f"(e.g. {assigned[:3]}): it loads weights, which an abstract build "
            "drops. Build from the configuration only (e.g. "
            "`Backbone(**config)`, not `from_preset`) and pass the weights "
            "file as TensorParallel(..., weights='model.weights.h5'), or pass "
            "the preset directory itself."
        )
    if not model.built:
        raise TensorParallelError(
            f"Model {model.name!r} was not built by its builder: a model built "
            "without weights needs its input shapes at construction (a "
            "functional model, a Sequential with keras.Input, or a KerasHub "
            "backbone). Build it in the builder (`model.build(shape)`)."
        )
    return model, weights


def is_materialised(variable) -> bool:
    """Whether a Keras variable holds a value (not deferred)."""
    return keras_variables.has_value(variable)


def initial_value(variable, index: int, seed: int):
    """The whole initial value of a deferred variable, the same on every rank.

    Args:
        variable: A variable built by `build_abstract`.
        index: Its position among the model's variables.
        seed: The job's initialisation seed.

    Returns:
        A CPU torch tensor of the variable's shape and dtype.
    """
    import torch

    state = random.getstate()
    with torch.random.fork_rng(devices=[]), keras.device("cpu"):
        random.seed(seed * 1_000_003 + index)
        torch.manual_seed(seed * 1_000_003 + index)
        try:
            initializer = keras_variables.variable_initializer(variable)
            value = initializer(variable.shape, dtype=variable.dtype)
        finally:
            random.setstate(state)
    return torch.as_tensor(value)


def mark_materialised(variables) -> None:
    """Drop materialised variables from Keras's list of deferred ones (Keras
    would otherwise initialise them again, over their shards, the next time
    it leaves a stateless scope)."""
    keras_variables.forget_deferred_initialization(variables)


def _preset_source(directory: str) -> tuple[Callable[[], Any] | Mapping, str | None]:
    config_path = os.path.join(directory, PRESET_CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise TensorParallelError(
            f"{directory!r} is not a preset directory: it has no "
            f"{PRESET_CONFIG_FILE}. Pass a model, a function building one, a "
            "Keras config dict, or a local KerasHub preset directory "
            "(download it first: keras_hub presets are directories holding "
            "config.json and model.weights.h5)."
        )
    with open(config_path) as file:
        config = json.load(file)
    weights = os.path.join(directory, PRESET_WEIGHTS_FILE)
    return config, weights if os.path.isfile(weights) else None
