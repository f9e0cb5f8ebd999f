"""The first batch a Keras epoch iterator yields, to plan with
(backend-neutral)."""

from __future__ import annotations

from keras_autoshard.compat import keras_private
from keras_autoshard.plans.sharding_plan import PlanError


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
