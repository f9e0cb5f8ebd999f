"""Restore a sharded checkpoint into a model, or rebuild the model from it.

Restoring reads each array's slices straight onto the target model's
current shardings: any mesh shape, any device count, or a single device.
Names, shapes and dtypes are checked against the checkpoint before anything
is read. `load_model_sharded` first rebuilds the model from the config the
step stores, then restores it. On the PyTorch backend (or a step PyTorch
wrote) the restore goes through `torch_dcp`.
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
    flatten_tree,
    model_state_tree,
    orbax_api,
    saved_plan,
)
from keras_autoshard.checkpoint.steps import (
    STATE_CHECKPOINTABLE,
    STEP_METADATA_FILE,
    TORCH_INFO_FILE,
    complete_steps,
    latest_step,
)
from keras_autoshard.compat import keras_saving
from keras_autoshard.errors import CheckpointError
from keras_autoshard.plans.sharding_plan import ShardingPlan


@dataclasses.dataclass(frozen=True)
class RestoredCheckpoint:
    """What `restore_checkpoint` read besides the arrays.

    Args:
        step: The step restored.
        path: Its directory.
        plan: The sharding plan saved with it, if any.
        metadata: The caller's metadata saved with it.
        data_iterator_state: The data-iterator state saved with it.
        skipped_groups: State groups only one side has, left alone: the
            model's optimizer state when restoring a weights-only save, or
            saved optimizer state when the model has no optimizer.

    Example:

    ```python
    restored = restore_checkpoint(model, "ckpt")
    print(restored.step, restored.metadata)
    if restored.plan is not None:
        print(restored.plan.mesh.describe())  # the mesh that saved it
    ```
    """

    step: int
    path: str
    plan: ShardingPlan | None
    metadata: Any
    data_iterator_state: Any
    skipped_groups: tuple[str, ...] = ()


def restore_checkpoint(
    model,
    directory: str | os.PathLike,
    step: int | None = None,
    data_iterator=None,
) -> RestoredCheckpoint:
    """Restore a checkpoint into `model`, each slice onto the device it belongs to.

    The model's variables keep the shardings they have now (its
    distribution's layout, or one device), whatever mesh wrote the
    checkpoint. Shapes, dtypes and variable names are checked against the
    checkpoint before anything is read.

    Args:
        model: A built Keras model with the same variables as the saved one.
            An optimizer that is not built yet is built first, under the
            active distribution (call this inside its `scope()`).
        directory: Checkpoint root (as given to `save_checkpoint` or
            `ShardedOrbaxCheckpoint`).
        step: The step to restore; the latest complete one by default.
        data_iterator: An object with `set_state(state)` to restore the saved
            input-pipeline state into.

    Returns:
        A `RestoredCheckpoint` with the step, plan and metadata.

    Raises:
        CheckpointError: no complete checkpoint, another model's checkpoint,
            a shape or dtype mismatch, or missing or damaged files.

    Example:

    ```python
    with PlanDistribution(new_plan).scope():      # another mesh is fine
        model = build_model()
        model.compile(optimizer="adam", loss="mse")
    restored = restore_checkpoint(model, "ckpt")
    print(restored.step, restored.metadata)
    ```
    """
    from keras_autoshard.runtime.sharded_arrays import abstract_like

    step = latest_step(directory) if step is None else step
    directory = os.path.abspath(os.fspath(directory))  # Orbax needs absolute paths
    path = os.path.join(directory, str(step))
    if step not in complete_steps(directory):
        raise CheckpointError(
            f"Step {step} is not a complete checkpoint in {directory} (complete: "
            f"{complete_steps(directory)})."
        )
    if torch_dcp.torch_backend() or torch_dcp.is_torch_step(path):
        ours = torch_dcp.restore_torch_or_explain(model, path)
        if data_iterator is not None and ours.get("data_iterator_state") is not None:
            data_iterator.set_state(ours["data_iterator_state"])
        return RestoredCheckpoint(
            step=step,
            path=path,
            plan=saved_plan(ours, os.path.join(path, TORCH_INFO_FILE)),
            metadata=ours.get("metadata"),
            data_iterator_state=ours.get("data_iterator_state"),
        )
    ocp = orbax_api()
    _build_optimizer(model)
    try:
        with ocp.Context():
            saved_tree = ocp.metadata(
                path, checkpointable_name=STATE_CHECKPOINTABLE
            ).metadata
            saved_custom = ocp.checkpointables_metadata(path).custom_metadata
    except Exception as error:
        raise CheckpointError(
            f"Cannot read the metadata of checkpoint {path} ({error}); its files "
            "are missing or damaged. Restore another step."
        ) from error
    if not isinstance(saved_tree, Mapping):
        raise CheckpointError(
            f"Cannot read the array metadata of checkpoint {path}: its files are "
            "missing or damaged. Restore another step."
        )
    ours = (saved_custom or {}).get(METADATA_KEY) or {}
    plan = saved_plan(ours, os.path.join(path, STEP_METADATA_FILE))
    target_tree = model_state_tree(model)
    model_optimizer_key = _optimizer_key(target_tree)
    # Keras keys the optimizer group by the optimizer's generated name ("adam",
    # "adam_1" for a second model in the process): match it by its place.
    target_tree = _with_optimizer_key(target_tree, _optimizer_key(saved_tree))
    skipped = sorted(set(target_tree) ^ set(saved_tree))
    target_tree = {k: v for k, v in target_tree.items() if k in saved_tree}
    saved_tree = {k: v for k, v in saved_tree.items() if k in target_tree}
    _check_same_arrays(saved_tree, target_tree, path)
    try:
        with ocp.Context():
            loaded = ocp.load_checkpointables(
                path, {STATE_CHECKPOINTABLE: abstract_like(target_tree)}
            )[STATE_CHECKPOINTABLE]
    except Exception as error:
        raise CheckpointError(
            f"Reading the arrays of checkpoint {path} failed ({error}). Shard files "
            "are missing or damaged; nothing was assigned. Restore another step."
        ) from error
    model.set_state_tree(_with_optimizer_key(loaded, model_optimizer_key))
    iterator_state = ours.get("data_iterator_state")
    if data_iterator is not None and iterator_state is not None:
        data_iterator.set_state(iterator_state)
    return RestoredCheckpoint(
        step=step,
        path=path,
        plan=plan,
        metadata=ours.get("metadata"),
        data_iterator_state=iterator_state,
        skipped_groups=tuple(skipped),
    )


def load_model_sharded(
    directory: str | os.PathLike,
    distribution=None,
    step: int | None = None,
    compile: bool = True,
):
    """Rebuild the model from a checkpoint's stored config and restore it sharded.

    Args:
        directory: Checkpoint root holding a `model_config` (saved by
            `save_checkpoint` or by the callback without `save_weights_only`).
        distribution: The Keras distribution to create the model under
            (`PlanDistribution`, `AutoShardDistribution`); `None`: the
            current one.
        step: The step; the latest complete one by default.
        compile: Restore the training configuration (optimizer, loss) too.

    Returns:
        `(model, RestoredCheckpoint)`.

    Example:

    ```python
    model, restored = load_model_sharded("ckpt", PlanDistribution(plan))
    ```
    """
    import contextlib

    ocp = orbax_api()
    step = latest_step(directory) if step is None else step
    directory = os.path.abspath(os.fspath(directory))  # Orbax needs absolute paths
    path = os.path.join(directory, str(step))
    try:
        with ocp.Context():
            stored = ocp.load_checkpointables(path, {CONFIG_CHECKPOINTABLE: None})
        config_json = stored[CONFIG_CHECKPOINTABLE]["config"]
    except Exception as error:
        raise CheckpointError(
            f"Checkpoint {path} has no readable model config ({error}). It was "
            "saved weights-only: build the model yourself and call "
            "restore_checkpoint."
        ) from error
    scope = (
        distribution.scope() if distribution is not None else contextlib.nullcontext()
    )
    with scope:
        model = keras_saving.model_from_config_json(config_json, compile=compile)
        restored = restore_checkpoint(model, directory, step)
    return model, restored


def _build_optimizer(model) -> None:
    """Build an unbuilt optimizer under the active distribution, or say how."""
    import keras

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return
    spread = any(len(v.value.sharding.device_set) > 1 for v in model.variables)
    if spread and keras.distribution.distribution() is None:
        raise CheckpointError(
            f"Model {model.name!r} is sharded but its optimizer is not built, and "
            "no distribution is active to lay its state out. Call "
            "restore_checkpoint inside the distribution's scope(), or build the "
            "optimizer there first: model.optimizer.build(model.trainable_variables)."
        )
    optimizer.build(model.trainable_variables)


def _optimizer_key(tree: Mapping) -> str | None:
    """The one key of a state tree's optimizer group (the optimizer's name)."""
    group = tree.get("optimizer_variables")
    if isinstance(group, Mapping) and len(group) == 1:
        return next(iter(group))
    return None


def _with_optimizer_key(tree: Mapping, key: str | None) -> dict[str, Any]:
    """`tree` with its optimizer group keyed `key` (unchanged when either
    side has no single-optimizer group)."""
    current = _optimizer_key(tree)
    if key is None or current is None or key == current:
        return dict(tree)
    return {**tree, "optimizer_variables": {key: tree["optimizer_variables"][current]}}


def _check_same_arrays(saved_tree: Mapping, target_tree: Mapping, path: str) -> None:
    saved = flatten_tree(saved_tree)
    target = flatten_tree(target_tree)
    missing = sorted(set(target) - set(saved))
    extra = sorted(set(saved) - set(target))
    if missing or extra:
        raise CheckpointError(
            f"Checkpoint {path} does not match this model: model variables not in "
            f"the checkpoint {missing[:8]}, checkpoint arrays the model lacks "
            f"{extra[:8]}. It is from another model (or another optimizer); "
            "restore into the model that wrote it."
        )
    problems = []
    for name, value in target.items():
        stored = saved[name]
        shape, dtype = tuple(value.shape), str(value.dtype)
        if tuple(stored.shape) != shape or str(stored.dtype) != dtype:
            problems.append(
                f"{name}: checkpoint {tuple(stored.shape)} {stored.dtype}, "
                f"model {shape} {dtype}"
            )
    if problems:
        raise CheckpointError(
            f"Checkpoint {path} has arrays of other shapes or dtypes than the "
            f"model: {problems[:8]}. Build the model with the saved config."
        )
