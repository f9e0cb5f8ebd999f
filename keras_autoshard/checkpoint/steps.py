"""Which steps of a checkpoint directory finished saving.

A step is `<directory>/<step>/`, written by Orbax (JAX backend) or by
`torch.distributed.checkpoint` (PyTorch backend, `torch_dcp`); both write
into a temporary directory renamed last, and a step counts only once its
final directory holds its metadata.
"""

from __future__ import annotations

import logging
import os
import re

from keras_autoshard.errors import CheckpointError

logger = logging.getLogger(__name__)

STATE_CHECKPOINTABLE = "pytree"
TORCH_INFO_FILE = "keras_autoshard.json"
_STEP_NAME = re.compile(r"^\d+$")
# What every finished Orbax step directory holds.
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
_TREE_METADATA_FILE = "_METADATA"


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """Steps in `directory` whose save finished, ascending.

    A step counts only when its directory has its final name (Orbax renames
    the temporary directory last) and holds its metadata files; directories
    of killed saves are ignored.

    Args:
        directory: Checkpoint root.

    Returns:
        The complete steps, oldest first.

    Example:

    ```python
    steps = keras_autoshard.ShardedCheckpoint.complete_steps("ckpt")  # [100, 200]
    if steps:
        keras_autoshard.restore_checkpoint(model, "ckpt", step=steps[-1])
    ```
    """
    directory = os.path.abspath(os.fspath(directory))  # Orbax needs absolute paths
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        step_dir = os.path.join(directory, name)
        if not _STEP_NAME.match(name) or not os.path.isdir(step_dir):
            continue
        tree_metadata = os.path.join(
            step_dir, STATE_CHECKPOINTABLE, _TREE_METADATA_FILE
        )
        orbax_done = os.path.exists(os.path.join(step_dir, STEP_METADATA_FILE))
        if (orbax_done and os.path.exists(tree_metadata)) or os.path.exists(
            os.path.join(step_dir, TORCH_INFO_FILE)
        ):
            steps.append(int(name))
        else:
            logger.warning("Skipping incomplete checkpoint %s", step_dir)
    return sorted(steps)


def latest_step(directory: str | os.PathLike) -> int:
    """The newest complete step in `directory`; `CheckpointError` if none."""
    steps = complete_steps(directory)
    if not steps:
        raise CheckpointError(
            f"No complete checkpoint in {os.fspath(directory)}: it has no finished "
            "step directory. Check the path, or train from scratch."
        )
    return steps[-1]
