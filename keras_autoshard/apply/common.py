"""Backend-neutral helpers over a Keras model's state: which parameter an
optimizer slot belongs to, and the first batch a Keras epoch iterator yields."""

from __future__ import annotations

from typing import Any

from keras_autoshard.compat import keras_private
from keras_autoshard.plans.sharding_plan import PlanError


def slot_prefix(path: str) -> str:
    """The prefix Keras gives the optimizer slots of the variable at `path`."""
    return path.replace("/", "_")


def slot_owner(slot, owners: dict[str, tuple[Any, Any]]) -> tuple[Any, Any] | None:
    """The (parameter, payload) pair an optimizer slot was made from.

    Keras names slots `<parameter path with / as _>_<slot name>`; the owner is
    the longest matching prefix whose variable has the slot's shape.

    Args:
        slot: An optimizer variable.
        owners: `slot_prefix(parameter.path)` → (parameter, payload).

    Returns:
        The owner's (parameter, payload), or `None` for variables that belong
        to no parameter (the iteration counter, the learning rate).
    """
    name = slot.name
    best = None
    for prefix, (variable, payload) in owners.items():
        if name.startswith(prefix + "_") and tuple(slot.shape) == tuple(variable.shape):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, (variable, payload))
    return None if best is None else best[1]


def first_batch(x, y=None, sample_weight=None, batch_size=None):
    """The first batch `fit` would make of this data (Keras's epoch
    iterator), packed as `(x, y, sample_weight)`.

    Raises:
        PlanError: the data yields no batch.
    """
    return _found(keras_private.first_epoch_batch(x, y, sample_weight, batch_size))


def first_batch_of(epoch_iterator):
    """The first batch of the Keras `EpochIterator` Keras hands a model to
    build from.

    Raises:
        PlanError: the iterator yields no batch.
    """
    return _found(keras_private.first_batch_of(epoch_iterator))


def _found(batch):
    if batch is None:
        raise PlanError("The dataset yielded no batch to plan with.")
    return batch
