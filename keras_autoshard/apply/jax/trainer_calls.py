"""What a distribution can read, without changing anything, about the Keras
trainer call that asks it for a data layout: the model, the batch, and the
batches still to come.

Keras's `Distribution` protocol hands a distribution shapes, never the model
(see docs/concepts.md, "When a model is planned"). These readers look at the
call stack (`keras_private.trainer_call_on_stack`): the nearest
trainer-method frame (`fit`, `evaluate`, `predict`, the `*_on_batch`
methods, `_symbolic_build`) gives the model and its epoch iterator, the
nearest Keras data-distribution frame the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from keras_autoshard.compat import keras_private, keras_variables
from keras_autoshard.errors import BatchSizeError


@dataclasses.dataclass(frozen=True)
class TrainerCall:
    """The Keras trainer call asking for a data layout.

    Args:
        model: The model whose trainer method runs.
        batch: The batch being distributed (`(x, y, sample_weight)` or `(x,)`),
            or `None` when no distribution frame holds one.
        method: The outermost trainer method (`"fit"`, `"predict"`, ...).
        epoch_iterator: Keras's `EpochIterator` of `fit`/`evaluate`/`predict`
            (knows the batch size and the last, partial batch), else `None`.
        state: The variable values Keras moved into its loop state (inside
            `fit`/`evaluate`/`predict` loops), else `None`.
    """

    model: keras.Model
    batch: Any
    method: str
    epoch_iterator: Any = None
    state: Any = None


def trainer_call_asking() -> TrainerCall | None:
    """The Keras trainer call that asked for a layout, read off the stack.

    Returns:
        A `TrainerCall`, or `None` when no trainer method is asking (for
        instance a user calling `get_data_layout` directly).
    """
    # Start above the distribution method that asked (this function's caller).
    found = keras_private.trainer_call_on_stack(depth=2)
    if found is None:
        return None
    model, method, batch, epoch_iterator, state = found
    return TrainerCall(
        model=model,
        batch=batch,
        method=method,
        epoch_iterator=epoch_iterator,
        state=state,
    )


def check_batch_sizes(
    call: TrainerCall, data_shape, axis_name: str, axis_size: int
) -> None:
    """Every batch of the call splits evenly over the data axis.

    Checks the batch being distributed and, when Keras knows them, the batch
    size and the last (partial) batch of the epoch, before the step runs.

    Args:
        call: The trainer call.
        data_shape: Shape of the tensor being distributed.
        axis_name: The data axis that splits the batch.
        axis_size: Its size (this process's part of it).

    Raises:
        BatchSizeError: a batch that does not divide, naming its size, the
            data axis and the fixes; the model's variables hold their values.
    """
    sizes = {"this batch": data_shape[0] if len(data_shape) else None}
    adapter = getattr(call.epoch_iterator, "data_adapter", None)
    if adapter is not None:
        steps = keras_private.epoch_steps(call.epoch_iterator)
        sizes["the batch size"] = _known(lambda: adapter.batch_size)
        partial = _known(lambda: adapter.has_partial_batch) and _known(
            lambda: adapter.partial_batch_size
        )
        last_reached = steps is None or steps >= (
            _known(lambda: adapter.num_batches) or 0
        )
        if partial and last_reached:
            sizes["the last batch"] = partial
    for what, rows in sizes.items():
        if rows is None or rows % axis_size == 0:
            continue
        _restore_loop_state(call)
        raise BatchSizeError(
            f"{call.model.name}.{call.method}: {what} has {rows} rows, which the "
            f"data axis {axis_name!r} (size {axis_size}) cannot split evenly. "
            f"Use a batch size that is a multiple of {axis_size}; for the last "
            "batch, drop the remainder (slice the data to a multiple of the "
            "batch size, or `dataset.batch(n, drop_remainder=True)`) or stop "
            "before it with `steps_per_epoch`."
        )


def _known(read):
    """A data adapter property, or `None` where the adapter cannot tell."""
    try:
        return read()
    except (NotImplementedError, AttributeError, TypeError):
        return None


def _restore_loop_state(call: TrainerCall) -> None:
    """Give the model back the values Keras moved into its loop state, so that
    it stays usable after the error."""
    if call.state is None:
        return
    groups = (
        call.model.trainable_variables,
        call.model.non_trainable_variables,
        getattr(call.model.optimizer, "variables", []),
        call.model.metrics_variables,
    )
    for variables, values in zip(groups, call.state):
        for variable, value in zip(variables, values):
            if not keras_variables.has_value(variable):
                variable.assign(value)
