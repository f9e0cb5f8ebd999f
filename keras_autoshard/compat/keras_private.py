"""Every Keras private the package relies on, each behind one named function.

Keras's public API does not reach everything a planner needs: the model of
the trainer call asking a distribution for a layout, a variable's layout and
value slots, the globals Keras keeps (name counters, variables awaiting
initialisation, the stateless scope), the saving traversal. Each use is
wrapped here, with the Keras versions it was checked on and what a user sees
if Keras changes it. `missing_privates()` checks that the installed Keras
still has every one of them.

Checked on keras 3.15.1 and keras-nightly 3.16.0.dev2026102704 unless a
function says otherwise. Keras is imported inside the functions, never at
import time (the package must not import Keras before the user has chosen a
backend), and PyTorch or TensorFlow only by the function that needs them.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# Part of a source file's path that marks it as Keras's own code.
KERAS_SOURCE_PATH_PART = "/keras/src/"

# Keras's global attributes the package reads or sets (`global_state`).
NAME_COUNTERS_ATTRIBUTE = "object_name_uids"
UNINITIALIZED_VARIABLES_ATTRIBUTE = "uninitialized_variables"
CALL_SCOPE_ATTRIBUTES = ("stateless_scope", "current_call_ctx", "symbolic_scope")

# Trainer methods whose frame names the model (`self`) asking for a layout.
_TRAINER_METHODS = frozenset(
    "_symbolic_build fit evaluate predict train_on_batch test_on_batch "
    "predict_on_batch".split()
)
# JAX trainer frames holding a batch -> their local holding it (3.15: the first).
_BATCH_HOLDERS = {
    "_get_distributed_iterator": "data",
    "_distribute_data": "data",
    "_maybe_symbolic_build": "data_batch",
}
# Outer trainer methods, whose locals hold the epoch iterator and the state.
ENTRY_METHODS = ("fit", "evaluate", "predict")


# ------------------------------------------------------------------ classes
def distribution_base() -> type:
    """Keras's `Distribution` base class, for the package's distributions to
    subclass (`keras.distribution` exports its subclasses, not the base).

    Private: `keras.src.distribution.distribution_lib.Distribution`.
    If it moves: `import keras_autoshard.apply...` fails, so
    `AutoShardDistribution` and `PlanDistribution` cannot be created.
    """
    from keras.src.distribution.distribution_lib import Distribution

    return Distribution


def compute_output_spec(function: Callable, *args) -> Any:
    """Run `function` (a model) on `KerasTensor`s as Keras's own symbolic
    build does: the model is built and no value is computed.

    Private: `keras.src.backend.compute_output_spec`.
    If it changes: a model not yet built cannot be planned on its first batch
    (`AutoShardDistribution`, `TensorParallel`).
    """
    from keras.src import backend

    return backend.compute_output_spec(function, *args)


def distribute_data(data) -> Any:
    """Lay a batch out as the JAX trainer does before a step: each array put
    on the active distribution's data layout.

    Private: `keras.src.backend.jax.trainer._distribute_data` (keras 3.16
    adds an `is_super_batch` argument, left at its default).
    If it changes: `inspect_compiled`, `inspect_forward` and
    `train_step_program` (and `keras-autoshard inspect`) fail.
    """
    from keras.src.backend.jax.trainer import _distribute_data

    return _distribute_data(data)


def initialize_rng() -> None:
    """Share one RNG seed across JAX processes, as `keras.distribution.
    initialize` does after `jax.distributed.initialize`.

    Private: `keras.src.backend.jax.distribution_lib.initialize_rng`.
    If it changes: `keras_autoshard.distributed.initialize()` fails on a multi-process
    job, or processes initialise variables with different seeds.
    """
    from keras.src.backend.jax.distribution_lib import initialize_rng as keras_init

    keras_init()


def to_torch_dtype(dtype) -> Any:
    """The `torch.dtype` of a Keras dtype name. Imports torch.

    Private: `to_torch_dtype` of `keras.src.backend.torch.core` (keras 3.15)
    or `.torch.ops.core` (keras 3.16); checked with torch 2.13 and 2.15.
    If it changes: sharding a model on the PyTorch backend without
    initialising its variables (loading a weights file) fails.
    """
    try:
        from keras.src.backend.torch.ops.core import to_torch_dtype as convert
    except ImportError:
        from keras.src.backend.torch.core import to_torch_dtype as convert
    return convert(dtype)


def torch_trainer_per_rank(model_class: type) -> type:
    """Class decorator: keras 3.16's PyTorch trainer neither wraps these
    models (DTensor shards) in DDP nor sums their metrics over the ranks.
    Private: torch `Trainer._initialize_ddp` and `.get_metrics_result` (3.16),
    overridden by `get_metrics_result` of `keras.src.trainers.trainer`'s
    `BaseTrainer` (keras 3.16) or `Trainer` (3.15).
    If they change: the first step fails ("mixed torch.Tensor and DTensor",
    "c10d.broadcast_.default") or a `Sum` metric counts each batch per rank.
    """
    from keras.src.trainers import trainer

    model_class._initialize_ddp = lambda self: None
    base = getattr(trainer, "BaseTrainer", None) or trainer.Trainer
    model_class.get_metrics_result = base.get_metrics_result
    return model_class


def torch_attention_on_local_blocks() -> bool:
    """Whether keras 3.16's PyTorch `dot_product_attention` computes on
    DTensors' local blocks (right only when its inputs are cut alike).
    Private: `keras.src.backend.torch.ops.nn.dot_product_attention`.
    If it changes: nothing fails; layer outputs stay as DTensor cuts them.
    """
    try:
        from keras.src.backend.torch.ops import nn
    except ImportError:  # keras 3.15: attention runs on the DTensors
        return False
    return ".to_local()" in inspect.getsource(nn.dot_product_attention)


# ------------------------------------------------------------- data and steps
def first_epoch_batch(x, y=None, sample_weight=None, batch_size=None):
    """The first batch Keras's `EpochIterator` makes of `fit`-style data, as
    `fit` would feed it (`(x, y, sample_weight)` packed), or `None` when the
    data yields no batch.

    Private: `keras.src.trainers.epoch_iterator.EpochIterator` and its
    iteration protocol (`(step, last_step, batches or iterator)` triples).
    If it changes: `TensorParallel.fit`/`evaluate`/`predict` cannot plan
    before their first step.
    """
    from keras.src.trainers.epoch_iterator import EpochIterator

    iterator = EpochIterator(
        x=x, y=y, sample_weight=sample_weight, batch_size=batch_size, shuffle=False
    )
    return first_batch_of(iterator)


def first_batch_of(epoch_iterator):
    """The first batch a Keras `EpochIterator` (as Keras hands one to
    `_symbolic_build`) yields, or `None` when it yields none.

    Private: the iteration protocol of `EpochIterator`: `(step, last_step,
    batches or iterator)` triples.
    If it changes: `TensorParallel` cannot plan on its first batch.
    """
    for _, _, data_or_iterator in epoch_iterator:
        if isinstance(data_or_iterator, (list, tuple)):
            return data_or_iterator[0]
        return next(data_or_iterator)
    return None


def epoch_steps(epoch_iterator) -> int | None:
    """The steps per epoch an `EpochIterator` was given (`steps_per_epoch`),
    `None` when it runs to the end of the data.

    Private: the `steps_per_epoch` attribute of Keras's `EpochIterator`.
    If it changes: a `fit` stopped before a last partial batch by
    `steps_per_epoch` is refused as if it reached that batch.
    """
    return getattr(epoch_iterator, "steps_per_epoch", None)


def trainer_call_on_stack(depth: int) -> tuple | None:
    """The Keras trainer call on the stack above the caller: `(model, method,
    batch, epoch_iterator, state)`, or `None` when no trainer method of a
    `keras.Model` is running.

    Walks the frames from `depth` above the caller outward: the outermost
    trainer-method frame of the innermost model gives the model and method
    (`fit`, `evaluate`, `predict`, the `*_on_batch` methods, `_symbolic_build`),
    the nearest JAX data-distribution frame the batch (for `predict_on_batch`,
    whose step gets its batch undistributed, the method's `x`), and the
    locals of `fit`/`evaluate`/`predict` their epoch iterator and the loop
    state Keras moved the variable values into.

    Private: `sys._getframe` and the frame locals of Keras's JAX trainer
    (`_BATCH_HOLDERS`, whose `data` on keras 3.16 stacks the batches of
    `steps_per_execution > 1` steps: the first is returned; `epoch_iterator`
    and `state` of `fit`/`evaluate`/`predict`; `x` of `predict_on_batch`).
    If they change: `AutoShardDistribution` cannot plan on the first batch
    (use `prepare(model, sample_input)`), and batch sizes are not checked
    before the step.
    """
    import keras

    frame = sys._getframe(depth + 1)
    batch = None
    found = None
    while frame is not None:
        name = frame.f_code.co_name
        if batch is None and name in _BATCH_HOLDERS:
            batch = frame.f_locals.get(_BATCH_HOLDERS[name])
            if frame.f_locals.get("is_super_batch") and batch is not None:
                batch = keras.tree.map_structure(
                    lambda stacked: None if stacked is None else stacked[0], batch
                )
        if name in _TRAINER_METHODS:
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.Model) and (found is None or owner is found[0]):
                found = (owner, name, frame.f_locals)
        frame = frame.f_back
    if found is None:
        return None
    model, method, local = found
    if batch is None and method == "predict_on_batch":
        batch = (local.get("x"),)
    if method not in ENTRY_METHODS:
        local = {}
    return model, method, batch, local.get("epoch_iterator"), local.get("state")


def symbolic_build(model, data_batch=None, iterator=None) -> None:
    """Build the model, its metrics, loss and optimizer from a batch's shapes,
    as `fit` does before its first step.

    Private: `Trainer._symbolic_build(iterator, data_batch)`; also the hook
    `TorchShardedModel` overrides (pass `super()` as `model` there).
    If it changes: `inspect_compiled` fails, and on PyTorch a sharded model's
    optimizer slots are not sharded before the first step.
    """
    model._symbolic_build(iterator=iterator, data_batch=data_batch)


def jax_state(model, **groups: bool) -> Any:
    """The variable values the JAX trainer passes its step, for the groups
    asked (`trainable_variables=True`, `optimizer_variables=True`, ...).

    Private: `JAXTrainer._get_jax_state` (keras 3.16: `Trainer._get_jax_state`).
    If it changes: `inspect_compiled` and `train_step_program` fail.
    """
    return model._get_jax_state(**groups)


def state_sharding_spec(model) -> Any:
    """The shardings of `(trainable, non_trainable, optimizer, metrics)` state
    that the JAX trainer gives its jitted steps as output shardings.

    Private: `JAXTrainer._get_state_sharding_spec`.
    If it changes: `inspect_compiled` fails.
    """
    return model._get_state_sharding_spec()


def nested_state_dict(model, variables) -> dict:
    """`model.get_state_tree()`'s nesting of `variables` (by path), holding
    backend tensors.

    Private: `Model._create_nested_dict(variables, "backend_tensor")`.
    If it changes: `save_checkpoint` of a model without an optimizer fails.
    """
    return model._create_nested_dict(variables, "backend_tensor")


def all_layers(layer, include_self: bool = True) -> list:
    """Every layer inside `layer`, at any depth (and `layer` itself).

    Private: `Layer._flatten_layers(include_self=...)`.
    If it changes: `rematerialize` cannot find the layers a plan names, and
    planning on another backend cannot name a model's layer modules.
    """
    return list(layer._flatten_layers(include_self=include_self))


def optimizer_distribution_strategy(optimizer) -> Any:
    """The `tf.distribute` strategy a TensorFlow-backend optimizer was made in
    (`None` when it has none, or off TensorFlow).

    Private: the `_distribution_strategy` attribute Keras's `TFOptimizer`
    sets at creation.
    If it changes: `TensorParallel` on TensorFlow remakes every optimizer
    passed to `compile` (built ones are refused).
    """
    return getattr(optimizer, "_distribution_strategy", None)


# ---------------------------------------------------------------- variables
def has_value(variable) -> bool:
    """Whether a Keras variable holds a value (not deferred, nor moved into
    a JAX trainer's loop state).

    Private: `Variable._value`.
    If it changes: loading, relayout and the abstract builds fail with an
    `AttributeError`.
    """
    return variable._value is not None


def set_value(variable, value) -> None:
    """Make `value` the variable's value as it is, with no conversion or
    copy (on PyTorch a `torch.nn.Parameter` holding a DTensor).

    Private: assigning `Variable._value`.
    If it changes: `TensorParallel(..., distributed_backend="torch")` cannot
    shard a model's variables.
    """
    variable._value = value


def variable_layout(variable) -> Any:
    """The `TensorLayout` a variable was given by a distribution, or `None`.

    Private: `Variable._layout` (set by the JAX `Variable`).
    If it changes: variables are laid out twice (distributions ask their plan
    again for a variable already placed).
    """
    return getattr(variable, "_layout", None)


def relayout(variable, layout) -> None:
    """Give a variable a new layout and move its value onto it (device to
    device; no full copy is assembled); a deferred variable takes the layout
    when it is initialised.

    Private: `Variable._layout`, `Variable._direct_assign` and
    `Variable._value` of the JAX backend.
    If they change: `AutoShardDistribution` and `TensorParallel` cannot
    apply a plan to a built model.
    """
    variable._layout = layout
    if variable._value is not None:
        variable._direct_assign(variable._value)


def deferred_layout(variable) -> Any:
    """The `TensorLayout` the active distribution gives a variable created
    without a value (asking the distribution now), or `None`.

    Private: `Variable._initialize_layout()` and `Variable._layout`.
    If they change: sharded loading of a deferred variable fails.
    """
    variable._initialize_layout()
    return variable._layout


def initialize_with(variable, value) -> None:
    """Give a variable created without a value its first value.

    Private: `Variable._initialize(value)`.
    If it changes: sharded loading into an abstractly built model fails.
    """
    variable._initialize(value)


def initialize_deferred(variable) -> None:
    """Initialise a deferred variable from its initializer now.

    Private: `Variable._deferred_initialize()`.
    If it changes: `load_preset_sharded` fails on a preset whose weights
    file lacks a variable.
    """
    variable._deferred_initialize()


def variable_initializer(variable) -> Callable:
    """The initializer a deferred variable will be initialised with.

    Private: `Variable._initializer`.
    If it changes: a PyTorch model built abstractly cannot be initialised
    shard by shard.
    """
    return variable._initializer


def forget_deferred_initialization(variables) -> None:
    """Keras will not initialise these variables again: they are removed
    from its list of variables awaiting initialisation (Keras would
    initialise them over their values the next time it leaves a stateless
    scope), and their initializers are dropped.

    Private: the `uninitialized_variables` global of
    `keras.src.backend.common.global_state`, and `Variable._initializer`.
    If they change: sharded PyTorch variables are overwritten with whole
    initial values.
    """
    from keras.src.backend.common import global_state

    pending = global_state.get_global_attribute(UNINITIALIZED_VARIABLES_ATTRIBUTE)
    done = {id(v) for v in variables}
    for variable in variables:
        variable._initializer = None
    if pending:
        pending[:] = [v for v in pending if id(v) not in done]


# ------------------------------------------------------------------ globals
@contextlib.contextmanager
def name_counters_kept() -> Iterator[None]:
    """Keras's auto-naming counters (`dense`, `dense_1`, ...) are as on entry
    after the block, so the next build gets the same names.

    Private: the `object_name_uids` global of
    `keras.src.backend.common.global_state`.
    If it changes: a model built for planning shifts the names of the next
    build, and plans keyed by variable path stop matching it.
    """
    from keras.src.backend.common import global_state

    saved = copy.copy(
        global_state.get_global_attribute(
            NAME_COUNTERS_ATTRIBUTE,
            default=collections.defaultdict(int),
            set_to_default=True,
        )
    )
    try:
        yield
    finally:
        global_state.set_global_attribute(NAME_COUNTERS_ATTRIBUTE, saved)


@contextlib.contextmanager
def pending_initializations_set_aside() -> Iterator[None]:
    """Keras's list of variables awaiting initialisation is empty inside the
    block and as on entry after it: variables created inside are never
    initialised by a later stateless scope.

    Private: the `uninitialized_variables` global.
    If it changes: abstract builds allocate every weight when a later
    stateless scope exits.
    """
    from keras.src.backend.common import global_state

    saved = list(
        global_state.get_global_attribute(UNINITIALIZED_VARIABLES_ATTRIBUTE, []) or []
    )
    global_state.set_global_attribute(UNINITIALIZED_VARIABLES_ATTRIBUTE, [])
    try:
        yield
    finally:
        global_state.set_global_attribute(UNINITIALIZED_VARIABLES_ATTRIBUTE, saved)


@contextlib.contextmanager
def outside_keras_call() -> Iterator[None]:
    """Step out of the Keras call being traced for the block (its stateless
    scope holds the step's tracers as variable values, its call context the
    layer being called, its symbolic scope a shape-only build) and back in
    after: the block sees the variables' real values. Keras's own scope
    objects are put back as they were.

    Private: the globals `CALL_SCOPE_ATTRIBUTES` names (the symbolic scope too).
    If they change: `AutoShardDistribution` cannot plan inside a traced
    call (`predict_on_batch`: call `prepare(model, x)` first).
    """
    from keras.src.backend.common import global_state

    saved = {
        name: global_state.get_global_attribute(name) for name in CALL_SCOPE_ATTRIBUTES
    }
    try:
        for name in CALL_SCOPE_ATTRIBUTES:
            global_state.set_global_attribute(name, None)
        yield
    finally:
        for name, value in saved.items():
            global_state.set_global_attribute(name, value)


def current_stateless_scope() -> Any:
    """The active `keras.StatelessScope`, or `None`.

    Private: `keras.src.backend.common.stateless_scope.get_stateless_scope`;
    the package also reads the scope's `state_mapping` and `losses`.
    If they change: a rematerialized layer that updates state (dropout's
    seed) fails in a train step.
    """
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


# ------------------------------------------------------------------- saving
def saved_weight_entries(model, skipped: Iterable = ()) -> list[tuple[str, str, Any]]:
    """What `model.save_weights` writes, in its order, without writing:
    `(group path, dataset key, value)` per saved value, the key as in a
    `.weights.h5` file (`layers/dense/vars/0`). Objects in `skipped` (the
    optimizer) are not traversed.

    Private: `keras.src.saving.saving_lib._save_state` and the protocol of
    its `H5IOStore` (`make(path, metadata)`, item assignment).
    If they change: weights files cannot be loaded or saved slice by slice
    (`load_weights_sharded`, `TensorParallel.load_weights` on PyTorch).
    """
    from keras.src.saving import saving_lib

    store = _recording_store_class()()
    saving_lib._save_state(
        model,
        weights_store=store,
        assets_store=None,
        inner_path="",
        visited_saveables={id(item) for item in skipped},
    )
    return store.entries


@functools.cache
def _recording_store_class() -> type:
    from keras.src.saving import saving_lib

    class RecordingStore(saving_lib.H5IOStore):
        """A write-mode weights store that records keys instead of writing."""

        def __init__(self):  # no file: nothing is written
            self.entries: list[tuple[str, str, Any]] = []
            self._group_path = ""

        def __bool__(self) -> bool:
            return True

        def make(self, path, metadata=None):
            self._group_path = path
            return self

        def __setitem__(self, key, value):
            dataset_key = f"{self._group_path}/vars/{key}".lstrip("/")
            self.entries.append((self._group_path, dataset_key, value))

    return RecordingStore


def model_from_config_json(config_json: str, compile: bool) -> Any:
    """The model a `.keras` archive's config JSON describes (safe mode),
    compiled when `compile` and the config holds a training configuration.

    Private: `keras.src.saving.saving_lib._model_from_config`.
    If it changes: `load_model_sharded` fails.
    """
    from keras.src.saving import saving_lib

    return saving_lib._model_from_config(
        config_json, custom_objects=None, compile=compile, safe_mode=True
    )


def model_config_json(model) -> str:
    """The config JSON `model.save` writes into a `.keras` archive.

    Private: `keras.src.saving.saving_lib._serialize_model_as_json`.
    If it changes: `save_checkpoint(..., include_model_config=True)` fails.
    """
    from keras.src.saving import saving_lib

    config_json, _ = saving_lib._serialize_model_as_json(model)
    return config_json


# ----------------------------------------------------------------- checking
def missing_privates() -> list[str]:
    """The Keras privates above that the installed Keras lacks.

    Imports Keras (and its JAX trainer when JAX is installed); reads the
    PyTorch and TensorFlow backends' source without importing them. The
    checks live in `compat/keras_checks.py`.

    Returns:
        One readable name per missing private (empty when all are there).

    Example:

    ```python
    from keras_autoshard.compat import keras_private
    assert keras_private.missing_privates() == []
    ```
    """
    from keras_autoshard.compat import keras_checks

    return keras_checks.missing(sys.modules[__name__])
