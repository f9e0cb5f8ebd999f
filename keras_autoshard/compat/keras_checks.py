"""The checks behind `keras_private.missing_privates()`: one per Keras
private `keras_private`, `keras_variables`, `keras_globals` and
`keras_saving` wrap, each a function that is true while the
installed Keras still has it (an exception counts as missing).

Signatures and frame locals are read with `inspect` and code objects; the
PyTorch and TensorFlow backends' files are read as text, so neither is
imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pathlib
from collections.abc import Callable
from types import ModuleType

from keras_autoshard.compat import keras_globals
from keras_autoshard.compat.checks import attribute, failing


def missing(private: ModuleType) -> list[str]:
    """Readable names of the checked Keras privates the installed Keras
    lacks; the JAX trainer's are checked only when JAX is installed.

    Args:
        private: The `keras_private` module (handed in, not imported: it
            imports this module), whose wrappers some checks run.
    """
    checks = list(_CHECKS)
    if importlib.util.find_spec("jax") is not None:
        checks += _JAX_TRAINER_CHECKS
    return failing(checks, private)


def _has_parameters(module: str, path: str, *names: str) -> bool:
    parameters = inspect.signature(attribute(module, path)).parameters
    return all(name in parameters for name in names)


def _local_names(function) -> set[str]:
    """Argument and local variable names of `function` (under Keras's
    traceback-filtering wrapper, if any)."""
    code = inspect.unwrap(function).__code__
    return set(code.co_varnames) | set(code.co_cellvars)


def _source_has(relative_path: str, *texts: str) -> bool:
    """Whether Keras's source file `keras/src/<relative_path>` holds every
    text (read without importing it: torch and tensorflow stay unimported)."""
    spec = importlib.util.find_spec("keras.src")
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / relative_path
        if path.is_file():
            source = path.read_text()
            return all(text in source for text in texts)
    return False


def _module_source_has(module: str, *texts: str) -> bool:
    source = inspect.getsource(importlib.import_module(module))
    return all(text in source for text in texts)


def _variable_has(*names: str) -> bool:
    import keras

    with keras_globals.name_counters_kept():
        variable = keras.Variable(0.0, name="keras_autoshard_compat_check")
    return all(hasattr(variable, name) for name in names)


def _stateless_scope_has(*names: str) -> bool:
    import keras

    scope = keras.StatelessScope()
    return all(hasattr(scope, name) for name in names)


def _first_epoch_batch_works(private: ModuleType) -> bool:
    import numpy as np

    x, y = np.zeros((4, 2), "float32"), np.zeros((4,), "float32")
    batch = private.first_epoch_batch(x, y, batch_size=2)
    return tuple(batch[0].shape) == (2, 2) and tuple(batch[1].shape) == (2,)


def _jax_trainer_class() -> type:
    module = importlib.import_module("keras.src.backend.jax.trainer")
    # keras 3.15 names it JAXTrainer, keras 3.16 Trainer.
    return getattr(module, "JAXTrainer", None) or module.Trainer


def _jax_variable_class() -> type:
    # keras 3.16 moved the JAX backend's core module into `ops/`.
    try:
        module = importlib.import_module(f"{_BACKEND}.jax.ops.core")
    except ImportError:
        module = importlib.import_module(f"{_BACKEND}.jax.core")
    return module.Variable


def _batch_frames_hold_data(_) -> bool:
    module = importlib.import_module("keras.src.backend.jax.trainer")
    if "data" not in _local_names(module._distribute_data):
        return False
    iterator_class = module.JAXEpochIterator
    if hasattr(iterator_class, "_get_distributed_iterator"):  # keras 3.15
        return "data" in _local_names(iterator_class._get_distributed_iterator)
    # keras 3.16: `_distribute_data` asks the layouts itself, and says
    # whether `data` stacks the batches of several steps; `fit` builds the
    # model's state from `_maybe_symbolic_build`'s raw `data_batch`.
    return (
        "get_layout" in inspect.getsource(module._distribute_data)
        and "is_super_batch" in _local_names(module._distribute_data)
        and "data_batch" in _local_names(module.Trainer._maybe_symbolic_build)
    )


def _entry_methods_hold_loop_locals(private: ModuleType) -> bool:
    trainer = _jax_trainer_class()
    return all(
        {"epoch_iterator", "state"} <= _local_names(getattr(trainer, name))
        for name in private.ENTRY_METHODS
    ) and "x" in _local_names(trainer.predict_on_batch)


_BACKEND = "keras.src.backend"
_GLOBAL_STATE = "keras.src.backend.common.global_state"
_SAVING = "keras.src.saving.saving_lib"

_CHECKS: list[tuple[str, Callable[[ModuleType], bool]]] = [
    (
        "keras.src.distribution.distribution_lib.Distribution",
        lambda _: _has_parameters(
            "keras.src.distribution.distribution_lib",
            "Distribution.__init__",
            "device_mesh",
            "batch_dim_name",
            "auto_shard_dataset",
        ),
    ),
    (
        f"{_BACKEND}.compute_output_spec",
        lambda _: attribute(_BACKEND, "compute_output_spec"),
    ),
    (
        f"{_BACKEND}.common.stateless_scope.get_stateless_scope",
        lambda _: attribute(
            f"{_BACKEND}.common.stateless_scope", "get_stateless_scope"
        ),
    ),
    (
        "keras.StatelessScope().state_mapping / .losses",
        lambda _: _stateless_scope_has("state_mapping", "losses"),
    ),
    (
        f"{_GLOBAL_STATE}.get_global_attribute / set_global_attribute",
        lambda _: (
            _has_parameters(
                _GLOBAL_STATE,
                "get_global_attribute",
                "name",
                "default",
                "set_to_default",
            )
            and attribute(_GLOBAL_STATE, "set_global_attribute")
        ),
    ),
    (
        "global attribute 'object_name_uids' (keras.src.utils.naming)",
        lambda _: _module_source_has(
            "keras.src.utils.naming", f'"{keras_globals.NAME_COUNTERS_ATTRIBUTE}"'
        ),
    ),
    (
        "global attribute 'uninitialized_variables' (Variable)",
        lambda _: _module_source_has(
            f"{_BACKEND}.common.variables",
            f'"{keras_globals.UNINITIALIZED_VARIABLES_ATTRIBUTE}"',
        ),
    ),
    (
        "global attributes 'stateless_scope', 'current_call_ctx', 'symbolic_scope'",
        lambda _: all(
            _module_source_has(module, f'"{name}"')
            for module, name in zip(
                (
                    f"{_BACKEND}.common.stateless_scope",
                    "keras.src.layers.layer",
                    f"{_BACKEND}.common.symbolic_scope",
                ),
                keras_globals.CALL_SCOPE_ATTRIBUTES,
                strict=True,
            )
        ),
    ),
    (
        "Variable._value / _layout / _initializer / _initialize / _deferred_initialize",
        lambda _: _variable_has(
            "_value",
            "_layout",
            "_initializer",
            "_initialize",
            "_deferred_initialize",
        ),
    ),
    (
        "Layer._flatten_layers(include_self)",
        lambda _: _has_parameters("keras", "Layer._flatten_layers", "include_self"),
    ),
    (
        "Trainer._symbolic_build(iterator, data_batch)",
        lambda _: _has_parameters(
            "keras", "Model._symbolic_build", "iterator", "data_batch"
        ),
    ),
    (
        "Model._create_nested_dict(variables, value_format)",
        lambda _: _has_parameters(
            "keras", "Model._create_nested_dict", "variables", "value_format"
        ),
    ),
    (
        "keras.src.trainers.epoch_iterator.EpochIterator (first batch)",
        _first_epoch_batch_works,
    ),
    (
        "EpochIterator.steps_per_epoch",
        lambda _: _module_source_has(
            "keras.src.trainers.epoch_iterator", "self.steps_per_epoch ="
        ),
    ),
    (
        f"{_SAVING}._save_state",
        lambda _: _has_parameters(
            _SAVING,
            "_save_state",
            "saveable",
            "weights_store",
            "assets_store",
            "inner_path",
            "visited_saveables",
        ),
    ),
    (
        f"{_SAVING}.H5IOStore.make(path, metadata)",
        lambda _: _has_parameters(_SAVING, "H5IOStore.make", "path", "metadata"),
    ),
    (
        f"{_SAVING}._model_from_config",
        lambda _: _has_parameters(
            _SAVING, "_model_from_config", "config_json", "custom_objects", "compile"
        ),
    ),
    (
        f"{_SAVING}._serialize_model_as_json",
        lambda _: attribute(_SAVING, "_serialize_model_as_json"),
    ),
    (
        "OrbaxCheckpoint.checkpointer.save_checkpointables",
        lambda _: _module_source_has(
            "keras.src.callbacks.orbax_checkpoint",
            "self.checkpointer.save_checkpointables(",
        ),
    ),
    (
        "keras.src.backend.torch(.ops).core.to_torch_dtype",
        lambda _: (
            _source_has("backend/torch/ops/core.py", "def to_torch_dtype(")
            or _source_has("backend/torch/core.py", "def to_torch_dtype(")
        ),
    ),
    (
        "torch Trainer._initialize_ddp (where it wraps models in DDP)",
        lambda _: (
            not _source_has("backend/torch/trainer.py", "DistributedDataParallel(")
            or _source_has(
                "backend/torch/trainer.py",
                "def _initialize_ddp(self)",
                "self._initialize_ddp()",
            )
        ),
    ),
    (
        "keras.src.trainers.trainer.BaseTrainer (3.16) / Trainer (3.15)"
        ".get_metrics_result",
        lambda _: callable(
            attribute(
                "keras.src.trainers.trainer",
                "BaseTrainer.get_metrics_result"
                if _source_has("trainers/trainer.py", "class BaseTrainer")
                else "Trainer.get_metrics_result",
            )
        ),
    ),
    (
        "TFOptimizer._distribution_strategy",
        lambda _: _source_has(
            "backend/tensorflow/optimizer.py", "self._distribution_strategy ="
        ),
    ),
    (
        "TensorLayout._validate_axes (overridden by compat.keras_layouts)",
        lambda _: (
            _source_has("distribution/distribution_lib.py", "self._validate_axes()")
            and attribute(
                "keras.src.distribution.distribution_lib", "TensorLayout"
            )._validate_axes
        ),
    ),
]

_JAX_TRAINER = "keras.src.backend.jax.trainer"
_JAX_TRAINER_CHECKS: list[tuple[str, Callable[[ModuleType], bool]]] = [
    (
        "JAX Variable._initialize_layout / _direct_assign",
        lambda _: all(
            callable(getattr(_jax_variable_class(), name))
            for name in ("_initialize_layout", "_direct_assign")
        ),
    ),
    (
        f"{_JAX_TRAINER}._distribute_data(data)",
        lambda _: _has_parameters(_JAX_TRAINER, "_distribute_data", "data"),
    ),
    (
        "the JAX trainer's batch frames (locals 'data' of _distribute_data or "
        "_get_distributed_iterator, 'is_super_batch' of _distribute_data)",
        _batch_frames_hold_data,
    ),
    (
        "locals 'epoch_iterator', 'state' of JAX fit/evaluate/predict, 'x' of "
        "predict_on_batch",
        _entry_methods_hold_loop_locals,
    ),
    (
        "JAX trainer _get_jax_state / _get_state_sharding_spec",
        lambda _: (
            all(
                name
                in inspect.signature(_jax_trainer_class()._get_jax_state).parameters
                for name in (
                    "trainable_variables",
                    "non_trainable_variables",
                    "optimizer_variables",
                    "metrics_variables",
                )
            )
            and callable(_jax_trainer_class()._get_state_sharding_spec)
        ),
    ),
    (
        "keras.src.backend.jax.distribution_lib.initialize_rng",
        lambda _: attribute(f"{_BACKEND}.jax.distribution_lib", "initialize_rng"),
    ),
]
