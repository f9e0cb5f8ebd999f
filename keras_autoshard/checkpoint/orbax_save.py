"""Save a model's sharded weights, optimizer and metric state with Orbax.

Every process writes only the array slices it owns, with the record of
`orbax_record` (plan, metadata, data-iterator state) and, by default, the
model's config. Orbax writes a step into a temporary directory and renames
it when complete; `complete_steps` lists only steps that finished, so a save
killed part way leaves the previous checkpoint the latest. On the PyTorch
backend the save goes through `torch_dcp`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from keras_autoshard.checkpoint import torch_dcp
from keras_autoshard.checkpoint.orbax_record import (
    CONFIG_CHECKPOINTABLE,
    METADATA_KEY,
    current_plan,
    custom_metadata,
    flatten_tree,
    model_state_tree,
    orbax_api,
)
from keras_autoshard.checkpoint.sharded_load import weights_owner
from keras_autoshard.checkpoint.steps import STATE_CHECKPOINTABLE
from keras_autoshard.compat import keras_saving
from keras_autoshard.errors import CheckpointError
from keras_autoshard.plans.sharding_plan import ShardingPlan


@dataclasses.dataclass
class PendingSave:
    """A save in progress; `wait()` blocks until it is on disk.

    Args:
        step: The step being saved.
        directory: The checkpoint root directory.
    """

    step: int
    directory: str
    _checkpointer: Any
    _response: Any

    def done(self, timeout_s: float = 0.0) -> bool:
        """Whether the save has finished (successfully or not).

        Args:
            timeout_s: Seconds to wait for it first.
        """
        if self._checkpointer is None:
            return True
        try:
            self._response.result(timeout=timeout_s)
        except TimeoutError:
            return False
        except Exception:  # failed: finished; wait() raises the error
            return True
        return True

    def wait(self) -> None:
        """Block until the step is committed, then release the writer."""
        if self._checkpointer is None:
            return
        try:
            self._response.result()
        finally:
            self._checkpointer.close()
            self._checkpointer = None


def save_checkpoint(
    model,
    directory: str | os.PathLike,
    step: int,
    plan: ShardingPlan | None = None,
    metadata: Any = None,
    data_iterator_state: Any = None,
    max_to_keep: int | None = None,
    include_model_config: bool = True,
    wait: bool = True,
    progress: bool = False,
) -> PendingSave:
    """Save `model`'s weights, optimizer and metric state, shard by shard.

    Args:
        model: A built Keras model (sharded or not).
        directory: Checkpoint root; the step goes to `<directory>/<step>`.
        step: Step number; saving a step that exists is an error.
        plan: The plan stored with the checkpoint; defaults to the active
            distribution's plan.
        metadata: JSON-serialisable value stored with the checkpoint.
        data_iterator_state: JSON-serialisable input-pipeline state.
        max_to_keep: Keep only this many latest steps (older are deleted).
        include_model_config: Store the model's Keras config, so that the
            checkpoint can rebuild the model.
        wait: Block until the step is on disk; with `False`, training can
            go on while it is written: call `wait()` on the result. The
            PyTorch backend saves synchronously only (`False` is an error).
        progress: Show a progress bar (on stderr) of the bytes written so
            far against this process's shard bytes, while waiting. Not on
            the PyTorch backend (`True` is an error).

    Returns:
        A `PendingSave` (already finished when `wait`).

    Raises:
        CheckpointError: the step exists, the save failed, or (PyTorch
            backend) `wait=False` or `progress=True` was asked for.

    Example:

    ```python
    save_checkpoint(model, "ckpt", step=100, metadata={"epoch": 3})
    pending = save_checkpoint(model, "ckpt", step=200, wait=False)
    model.fit(...)          # runs while step 200 is written
    pending.wait()
    ```
    """
    directory = os.path.abspath(os.fspath(directory))  # Orbax needs absolute paths
    if torch_dcp.torch_backend():  # torch.distributed.checkpoint, rank by rank
        torch_dcp.check_save_arguments(wait, progress)
        if plan is None:
            plan = getattr(model, "plan", None)
        info = custom_metadata(plan, metadata, None)
        info = dict(info[METADATA_KEY], data_iterator_state=data_iterator_state)
        if include_model_config:
            info["model_config"] = _model_config_json(weights_owner(model))
        torch_dcp.save_checkpoint_torch(model, directory, step, info, max_to_keep)
        return PendingSave(step, directory, None, None)
    payload: dict[str, Any] = {STATE_CHECKPOINTABLE: model_state_tree(model)}
    if include_model_config:
        payload[CONFIG_CHECKPOINTABLE] = {"config": _model_config_json(model)}
    info = custom_metadata(current_plan(plan), metadata, data_iterator_state)
    ocp = orbax_api()
    checkpointer = new_checkpointer(directory, max_to_keep)
    try:
        with ocp.Context():
            response = checkpointer.save_checkpointables_async(
                step, payload, custom_metadata=info
            )
    except Exception as error:
        checkpointer.close()
        raise CheckpointError(
            f"Saving step {step} to {directory} failed: {error}. A step that "
            "exists already cannot be overwritten: use a new step number."
        ) from error
    pending = PendingSave(step, directory, checkpointer, response)
    if wait:
        if progress:
            _show_save_progress(pending, payload[STATE_CHECKPOINTABLE])
        pending.wait()
    return pending


def _show_save_progress(pending: PendingSave, state_tree: Mapping) -> None:
    """Poll the step's folder until the save is done, as a bar of bytes."""
    from keras_autoshard.progress import progress_bar
    from keras_autoshard.runtime.sharded_arrays import local_shard_bytes

    expected = sum(local_shard_bytes(v) for v in flatten_tree(state_tree).values())
    mib = 2**20
    with progress_bar(
        f"saving step {pending.step} (MiB)", total=round(expected / mib, 1)
    ) as task:
        written = 0.0
        while not pending.done(timeout_s=0.1):
            now = min(_folder_bytes(pending.directory) / mib, expected / mib)
            task.advance(max(0.0, now - written))
            written = max(written, now)
        task.advance(max(0.0, expected / mib - written))


def _folder_bytes(directory: str) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # renamed or removed while the save commits
                continue
    return total


def new_checkpointer(directory: str, max_to_keep: int | None = None):
    """An Orbax `training.Checkpointer` like the one Keras's callback makes."""
    ocp = orbax_api()

    policy = (
        ocp.training.preservation_policies.LatestN(max_to_keep)
        if max_to_keep is not None
        else None
    )
    return ocp.training.Checkpointer(
        directory=directory,
        preservation_policy=policy,
        save_decision_policy=ocp.training.save_decision_policies.FixedIntervalPolicy(1),
    )


def _model_config_json(model) -> str:
    try:
        return keras_saving.model_config_json(model)
    except Exception as error:
        raise CheckpointError(
            f"Model {model.name!r} cannot be serialised to a config ({error}). "
            "Implement get_config, or save with include_model_config=False."
        ) from error
