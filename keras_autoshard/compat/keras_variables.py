"""A Keras variable's private slots, each use behind one named function:
its value, its layout, its deferred initialisation and initializer.

Checked on keras 3.15.1 and keras-nightly 3.16.0.dev2026102704 unless a
function says otherwise; `keras_private.missing_privates()` checks these too.
Keras is imported inside the functions, never at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_autoshard.compat.keras_globals import UNINITIALIZED_VARIABLES_ATTRIBUTE


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


def reset_placement(variable, value) -> None:
    """Forget the layout a distribution gave a variable and make `value`
    (already placed) its value, as a model built with no distribution
    holds it.

    Private: `Variable._layout` and `Variable._value` of the JAX backend.
    If they change: the model-coverage check cannot undo one mesh's plan
    before the next (`keras_autoshard.testing.model_coverage`).
    """
    variable._layout = None
    variable._value = value


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
