"""Command-line model sources, sample batches, meshes and byte sizes.

A model comes from one of three sources: a KerasHub class and its config
(`--hub GPT2Backbone --config cfg.json`), a Python builder function
(`--builder pkg.module:function`) or a saved `.keras` file. Each gives a
function with no arguments that builds the model, so the planner can build
it abstractly (no weights) and `inspect` can build it again under a
distribution. Sample batches are made from the model's symbolic inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys
import zipfile
from collections.abc import Callable, Sequence

import numpy as np

from keras_autoshard.errors import (
    ModelSourceError,  # noqa: F401
    PlanError,
)
from keras_autoshard.plans.mesh import DEFAULT_AXIS_NAMES
from keras_autoshard.plans.sharding_plan import MeshSpec
from keras_autoshard.plans.units import byte_size


def parse_byte_size(text: str) -> int:
    """`"16GiB"` → 17179869184, for argparse (see `plans.units.byte_size`).

    Raises:
        argparse.ArgumentTypeError: for anything that is not a size.
    """
    try:
        return byte_size(text)
    except PlanError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """`"2x4"` → `(2, 4)`.

    Args:
        text: Axis sizes (>= 1) joined by `x`.

    Returns:
        The mesh shape.

    Raises:
        argparse.ArgumentTypeError: for anything else.

    Example:

    ```python
    parse_mesh_shape("2x4")  # (2, 4)
    ```
    """
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(size < 1 for size in shape):
        raise argparse.ArgumentTypeError(
            f"mesh must look like 2x4 (sizes >= 1 joined by 'x'), got {text!r}"
        )
    return shape


def mesh_from_args(
    shape: Sequence[int] | None, axis_names: Sequence[str] | None
) -> MeshSpec | None:
    """The requested mesh, or `None` to let the planner choose the shape.

    Args:
        shape: Mesh shape from `--mesh`, or `None`.
        axis_names: Names from `--axis-names`; default `("batch", "model")`.

    Returns:
        A `MeshSpec`, or `None` when no shape was given.
    """
    if shape is None:
        return None
    names = tuple(axis_names) if axis_names else DEFAULT_AXIS_NAMES
    return MeshSpec(tuple(shape), names)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """How to build the model a command works on.

    Args:
        description: For messages (`"KerasHub GPT2Backbone"`, a path, ...).
        build: Builds the model (random or no weights).
        weights_path: A file holding the model's weights, if any.
    """

    description: str
    build: Callable[[], object]
    weights_path: str | None = None


def load_json_config(text: str | None) -> dict:
    """A config from a JSON file path or inline JSON text (`None` → `{}`)."""
    if text is None:
        return {}
    if os.path.exists(text):
        with open(text, encoding="utf-8") as f:
            text = f.read()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ModelSourceError(
            f"--config is neither an existing file nor valid JSON ({error}): "
            f"{text[:80]!r}"
        ) from error
    if not isinstance(config, dict):
        raise ModelSourceError(
            f"--config must be a JSON object of constructor arguments, got "
            f"{type(config).__name__}."
        )
    return config


def hub_source(class_name: str, config: dict) -> ModelSource:
    """A KerasHub model class built from `config` (no download).

    Args:
        class_name: A class in `keras_hub.models`, e.g. `"GPT2Backbone"`.
        config: Its constructor arguments.

    Returns:
        A `ModelSource`.
    """
    import keras_hub

    model_class = getattr(keras_hub.models, class_name, None)
    if model_class is None:
        raise ModelSourceError(
            f"keras_hub.models has no class {class_name!r} (keras-hub "
            f"{keras_hub.__version__}); backbones are named like GPT2Backbone, "
            "GemmaBackbone, LlamaBackbone."
        )

    check_sizes_are_positive(class_name, config)

    def build():
        try:
            model = model_class(**config)
        except (TypeError, ValueError) as error:
            raise ModelSourceError(
                f"{class_name}(**config) failed: {error}. Check the keys of --config."
            ) from error
        if not model.weights:
            raise ModelSourceError(
                f"{class_name}(**config) built a model with no weights: check "
                "the layer counts and sizes of --config."
            )
        return model

    return ModelSource(f"KerasHub {class_name}", build)


# Constructor arguments that count or size something: zero or less builds a
# model with nothing in it (KerasHub accepts `num_layers=-1` and builds none).
_SIZE_ARGUMENT = re.compile(r"^(num_\w+|\w+_(dim|size|layers|heads|experts|length))$")


def check_sizes_are_positive(class_name: str, config: dict) -> None:
    """Refuse counts and sizes of zero or less, naming the field.

    Args:
        class_name: The model class, for the message.
        config: Its constructor arguments.

    Raises:
        ModelSourceError: a count or size argument that is not positive.
    """
    for field, value in sorted(config.items()):
        if (
            _SIZE_ARGUMENT.match(field)
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value <= 0
        ):
            raise ModelSourceError(
                f"--config field {field!r} of {class_name} is {value}: it counts "
                "or sizes part of the model and must be at least 1 (a value of "
                f"{value} builds an empty or degenerate model)."
            )


def builder_source(spec: str, config: dict) -> ModelSource:
    """A Python function `module:function` returning a model.

    The current directory is importable, as for `python -m`.

    Args:
        spec: `"package.module:function"`.
        config: Keyword arguments for the function.

    Returns:
        A `ModelSource`.
    """
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ModelSourceError(
            f"--builder must look like package.module:function, got {spec!r}."
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelSourceError(
            f"Cannot import {module_name!r} for --builder ({error}). Run from the "
            "directory that holds it or add it to PYTHONPATH."
        ) from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ModelSourceError(
            f"{module_name} has no function {function_name!r} for --builder."
        )
    return ModelSource(spec, lambda: function(**config))


def keras_file_source(path: str) -> ModelSource:
    """A model saved with `model.save("model.keras")`.

    The model is rebuilt from the archive's config; its weights are read
    separately (slice by slice) by whoever needs them.

    Args:
        path: The `.keras` file.

    Returns:
        A `ModelSource` whose `weights_path` is `path`.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            config_text = archive.read("config.json").decode("utf-8")
        json.loads(config_text)
    except (OSError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as error:
        raise ModelSourceError(
            f"Cannot read {path} as a .keras file ({error}); save the model with "
            "model.save('model.keras')."
        ) from error

    def build():
        import keras

        # Deserialising consumes the config dict: parse a fresh one per build.
        return keras.saving.deserialize_keras_object(json.loads(config_text))

    return ModelSource(path, build, weights_path=path)


def sample_batch(
    model,
    batch_size: int,
    seq_len: int,
    input_shape: Sequence[int] | None = None,
):
    """One batch of inputs matching the model's symbolic inputs.

    Unknown dimensions are filled with `batch_size` (the first) and
    `seq_len` (the others). Integer inputs are zeros, inputs whose name says
    `mask` are ones, float inputs are standard normal. A model without
    symbolic inputs (subclassed) needs `input_shape`.

    Args:
        model: A built Keras model (its variables may be abstract).
        batch_size: Global batch size.
        seq_len: Size of the other unknown dimensions.
        input_shape: Shape of a single float input without the batch
            dimension, for models without symbolic inputs.

    Returns:
        Arrays in the structure the model takes (array, list or dict).
    """
    import keras

    if input_shape is not None:
        return _array("x", (batch_size, *input_shape), "float32")
    try:
        symbolic = model.input
    except (AttributeError, ValueError) as error:
        raise ModelSourceError(
            f"Model {model.name!r} has no symbolic inputs (a subclassed model?): "
            "give --input-shape, the shape of one example without the batch "
            "dimension, e.g. --input-shape 16x64."
        ) from error

    def make(tensor):
        shape = tuple(
            (batch_size if dim == 0 else seq_len) if size is None else size
            for dim, size in enumerate(tensor.shape)
        )
        return _array(getattr(tensor, "name", "") or "", shape, str(tensor.dtype))

    return keras.tree.map_structure(make, symbolic)


def sample_targets(model, inputs, shapes_only: bool = False):
    """Float targets shaped like the model's outputs for `inputs` (for MSE).

    Args:
        model: A built Keras model (its variables may be abstract).
        inputs: A batch of inputs (arrays or shape structs).
        shapes_only: Give `jax.ShapeDtypeStruct`s, allocating nothing (a
            70B model's targets for a batch of 256 x 4096 tokens are 32 GiB).

    Returns:
        Arrays (or shape structs) in the structure of the model's outputs.
    """
    import keras

    symbolic = keras.tree.map_structure(
        lambda array: keras.KerasTensor(array.shape, dtype=str(array.dtype)), inputs
    )
    outputs = model.compute_output_spec(symbolic)
    if shapes_only:
        import jax

        return keras.tree.map_structure(
            lambda spec: jax.ShapeDtypeStruct(tuple(spec.shape), np.float32), outputs
        )
    rng = np.random.default_rng(1)
    return keras.tree.map_structure(
        lambda spec: rng.standard_normal(tuple(spec.shape)).astype("float32"),
        outputs,
    )


def _array(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if "mask" in name.lower():
        return np.ones(shape, dtype)
    if np.issubdtype(np.dtype(dtype), np.integer) or dtype == "bool":
        return np.zeros(shape, dtype)
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)
