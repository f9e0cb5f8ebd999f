"""`ShardedOrbaxCheckpoint`: Keras's `OrbaxCheckpoint` with what sharded
training also needs saved.

Keras's callback already saves asynchronously, every N batches or every
epoch, best-only and with `max_to_keep`, and each process writes only its own
slices. This subclass keeps all of that and adds, to every step's custom
metadata: the sharding plan, the caller's metadata and the data-iterator
state. It does so by handing Keras's callback a checkpointer that adds
`custom_metadata` to each save, leaving Keras's saving logic untouched.
Restore with `restore_checkpoint`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import keras

from keras_autoshard.checkpoint.orbax_record import current_plan, custom_metadata
from keras_autoshard.errors import CheckpointError
from keras_autoshard.plans.sharding_plan import ShardingPlan


class ShardedOrbaxCheckpoint(keras.callbacks.OrbaxCheckpoint):
    """Keras's `OrbaxCheckpoint`, also saving the plan, metadata and data state.

    Args:
        directory: Checkpoint root directory.
        metadata: JSON-serialisable value, or a function of the step
            returning one, stored with every checkpoint.
        data_iterator: An object with `get_state()` returning the input
            pipeline's JSON-serialisable state (a Grain iterator, say); it is
            stored with every checkpoint and `restore_checkpoint` gives it
            back.
        plan: The plan to store; defaults to the active distribution's.
        **kwargs: Everything `keras.callbacks.OrbaxCheckpoint` takes
            (`save_freq`, `max_to_keep`, `save_best_only`, `monitor`, `mode`,
            `save_on_background`, `save_weights_only`, ...).

    Example:

    ```python
    callback = ShardedOrbaxCheckpoint("ckpt", save_freq=100, max_to_keep=3,
                                      metadata={"run": "a"})
    model.fit(x, y, callbacks=[callback])
    restored = restore_checkpoint(model, "ckpt")
    ```
    """

    # `ShardedCheckpoint` counts it as one of its own (`isinstance`).
    _is_sharded_checkpoint = True

    def __init__(
        self,
        directory,
        metadata: Any = None,
        data_iterator=None,
        plan: ShardingPlan | None = None,
        **kwargs,
    ):
        if keras.backend.backend() == "torch":
            raise CheckpointError(
                "ShardedOrbaxCheckpoint saves JAX arrays with Orbax; on the "
                "PyTorch backend use keras_autoshard.ShardedCheckpoint("
                f"{os.fspath(directory)!r}, save_freq=..., max_to_keep=...), "
                "which saves with torch.distributed.checkpoint there (each "
                "rank its shards)."
            )
        super().__init__(directory, **kwargs)
        self._metadata = metadata
        self._data_iterator = data_iterator
        self._plan = plan
        self.checkpointer = _CheckpointerWithMetadata(
            self.checkpointer, self._custom_metadata
        )

    def _custom_metadata(self, step: int) -> dict[str, Any]:
        metadata = self._metadata(step) if callable(self._metadata) else self._metadata
        iterator_state = (
            self._data_iterator.get_state() if self._data_iterator is not None else None
        )
        return custom_metadata(current_plan(self._plan), metadata, iterator_state)


class _CheckpointerWithMetadata:
    """An Orbax `training.Checkpointer` that adds custom metadata to each save."""

    def __init__(self, checkpointer, make_metadata: Callable[[int], dict]):
        self._checkpointer = checkpointer
        self._make_metadata = make_metadata

    def save_checkpointables(self, step, checkpointables, **kwargs):
        kwargs.setdefault("custom_metadata", self._make_metadata(step))
        return self._checkpointer.save_checkpointables(step, checkpointables, **kwargs)

    def save_checkpointables_async(self, step, checkpointables, **kwargs):
        kwargs.setdefault("custom_metadata", self._make_metadata(step))
        return self._checkpointer.save_checkpointables_async(
            step, checkpointables, **kwargs
        )

    def __getattr__(self, name):
        return getattr(self._checkpointer, name)
