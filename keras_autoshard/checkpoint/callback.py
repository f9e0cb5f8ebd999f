"""`ShardedCheckpoint`: one checkpoint callback for `fit` on either backend.

It builds the backend's own callback: `ShardedOrbaxCheckpoint` on JAX (Keras's
`OrbaxCheckpoint`, also saving the plan, metadata and data state) and
`ShardedTorchCheckpoint` on PyTorch (torch.distributed.checkpoint, each rank
its shards). Both save every `save_freq` batches or every epoch, keep
`max_to_keep` complete steps, and store `metadata` and the `data_iterator`'s
state; `restore_checkpoint` restores either.
"""

from __future__ import annotations

import os
from typing import Any

from keras_autoshard.checkpoint import steps


class _EitherBackend(type):
    """`isinstance(x, ShardedCheckpoint)` holds for either backend's callback."""

    def __instancecheck__(cls, instance) -> bool:
        return bool(getattr(type(instance), "_is_sharded_checkpoint", False))

    def __subclasscheck__(cls, subclass) -> bool:
        return bool(getattr(subclass, "_is_sharded_checkpoint", False))


class ShardedCheckpoint(metaclass=_EitherBackend):
    """Save sharded checkpoints during `fit`, whichever backend runs it.

    Args:
        directory: Checkpoint root; step `s` goes to `<directory>/<s>`.
        save_freq: `"epoch"`, or a number of batches.
        max_to_keep: Keep only this many latest complete steps (1, as
            Keras's `OrbaxCheckpoint`); `None` keeps every step.
        metadata: JSON-serialisable value, or a function of the step
            returning one, stored with every step.
        data_iterator: An object with `get_state()` returning the input
            pipeline's JSON-serialisable state, stored with every step.
        **kwargs: What the backend's callback takes besides: on JAX,
            `plan` and everything `keras.callbacks.OrbaxCheckpoint` takes
            (`save_best_only`, `monitor`, `save_weights_only`, ...). The
            PyTorch callback takes none; it raises `TypeError` naming one.

    Returns:
        The backend's callback (`isinstance(callback, ShardedCheckpoint)`
        holds for both).

    Example:

    ```python
    callback = keras_autoshard.ShardedCheckpoint("ckpt", save_freq=100,
                                                 max_to_keep=3)
    model.fit(x, y, callbacks=[callback])
    keras_autoshard.restore_checkpoint(model, "ckpt")  # the latest step
    ```
    """

    # The steps of a directory whose save finished, for either backend.
    complete_steps = staticmethod(steps.complete_steps)

    def __new__(
        cls,
        directory: str | os.PathLike,
        save_freq: int | str = "epoch",
        max_to_keep: int | None = 1,
        metadata: Any = None,
        data_iterator=None,
        **kwargs,
    ):
        import keras

        common = dict(
            save_freq=save_freq,
            max_to_keep=max_to_keep,
            metadata=metadata,
            data_iterator=data_iterator,
        )
        if keras.backend.backend() == "torch":
            from keras_autoshard.checkpoint.torch_callback import (
                ShardedTorchCheckpoint,
            )

            return ShardedTorchCheckpoint(directory, **common, **kwargs)
        from keras_autoshard.checkpoint.orbax_callback import ShardedOrbaxCheckpoint

        return ShardedOrbaxCheckpoint(directory, **common, **kwargs)
