"""Keras's trainer, distribution and backend privates, each behind one
named function, and the check of every Keras private the package relies on.

Keras's public API does not reach everything a planner needs: the model of
the trainer call asking a distribution for a layout, the first batch of
`fit`-style data, the trainer's jitted state, the PyTorch and TensorFlow
backends' trainers. Each use is wrapped here, with the Keras versions it was
checked on and what a user sees if Keras changes it. The other Keras
privates live beside it, one module per concern: `keras_variables` (a
variable's value, layout and initializer slots), `keras_globals` (the
globals Keras keeps: name counters, variables awaiting initialisation, the
stateless scope) and `keras_saving` (the saving traversal, the model config).
`missing_privates()` checks that the installed Keras still has every one of
them.

Checked on keras 3.15.1 and keras-nightly 3.16.0.dev2026102704 unless a
function says otherwise. Keras is imported inside the functions, never at
import time (the package must not import Keras before the user has chosen a
backend), and PyTorch or TensorFlow only by the function that needs them.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

# Part of a source file's path that marks it as Keras's own code.
KERAS_SOURCE_PATH_PART = "/keras/src/"

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


# ----------------------------------------------------------------- checking
def missing_privates() -> list[str]:
    """The Keras privates above, and those of `keras_variables`,
    `keras_globals` and `keras_saving`, that the installed Keras lacks.

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
