"""`ShardedTorchCheckpoint`: the checkpoint callback of the PyTorch backend.

The same promises as `ShardedOrbaxCheckpoint` on JAX, through
`save_checkpoint` (torch.distributed.checkpoint): every N batches or every
epoch, each rank writes its own shards; the plan, model config, the caller's
metadata and the data-iterator state are stored with every step; a step
becomes visible only once complete; `max_to_keep` drops the oldest. Every
rank runs the callback (Keras calls it on every rank's `fit`). Restore with
`restore_checkpoint`.
"""

from __future__ import annotations

import os
from typing import Any

import keras

from keras_autoshard.checkpoint.orbax_save import save_checkpoint
from keras_autoshard.errors import CheckpointError


class ShardedTorchCheckpoint(keras.callbacks.Callback):
    """Save sharded checkpoints during `fit` on the PyTorch backend.

    Args:
        directory: Checkpoint root; step `s` goes to `<directory>/<s>`.
        save_freq: `"epoch"` (step = the epoch index, as Keras's
            `OrbaxCheckpoint`), or a number of batches (step = batches seen
            since training began).
        max_to_keep: Keep only this many latest complete steps.
        metadata: JSON-serialisable value, or a function of the step
            returning one, stored with every step.
        data_iterator: An object with `get_state()` returning the input
            pipeline's JSON-serialisable state, stored with every step.

    Example:

    ```python
    # KERAS_BACKEND=torch torchrun --nproc-per-node 4 train.py
    callback = ShardedTorchCheckpoint("ckpt", save_freq=100, max_to_keep=3)
    tp.fit(x, y, callbacks=[callback])
    restore_checkpoint(tp, "ckpt")  # the latest complete step
    ```
    """

    # `ShardedCheckpoint` counts it as one of its own (`isinstance`).
    _is_sharded_checkpoint = True

    def __init__(
        self,
        directory: str | os.PathLike,
        save_freq: int | str = "epoch",
        max_to_keep: int | None = None,
        metadata: Any = None,
        data_iterator=None,
    ):
        super().__init__()
        if save_freq != "epoch" and not (
            isinstance(save_freq, int)
            and not isinstance(save_freq, bool)
            and save_freq > 0
        ):
            raise CheckpointError(
                f"save_freq={save_freq!r}: use 'epoch' or a positive number of batches."
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise CheckpointError(f"max_to_keep={max_to_keep!r} must be at least 1.")
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self._metadata = metadata
        self._data_iterator = data_iterator
        self._batches_seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches_seen += 1
        if self.save_freq != "epoch" and self._batches_seen % self.save_freq == 0:
            self._save(self._batches_seen)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch)

    def _save(self, step: int) -> None:
        metadata = self._metadata(step) if callable(self._metadata) else self._metadata
        iterator_state = (
            self._data_iterator.get_state() if self._data_iterator is not None else None
        )
        save_checkpoint(
            self.model,
            self.directory,
            step=step,
            metadata=metadata,
            data_iterator_state=iterator_state,
            max_to_keep=self.max_to_keep,
        )
