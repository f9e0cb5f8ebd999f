"""The global state Keras keeps, each use behind one named function:
its auto-naming counters, its list of variables awaiting initialisation, and
the scopes of the call being traced (stateless scope, call context, symbolic
scope).

Checked on keras 3.15.1 and keras-nightly 3.16.0.dev2026102704 unless a
function says otherwise; `keras_private.missing_privates()` checks these too.
Keras is imported inside the functions, never at import time.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Iterator
from typing import Any

# Keras's global attributes the package reads or sets (`global_state`).
NAME_COUNTERS_ATTRIBUTE = "object_name_uids"
UNINITIALIZED_VARIABLES_ATTRIBUTE = "uninitialized_variables"
CALL_SCOPE_ATTRIBUTES = ("stateless_scope", "current_call_ctx", "symbolic_scope")


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
