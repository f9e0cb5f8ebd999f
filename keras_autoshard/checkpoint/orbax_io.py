"""Save and restore sharded weights and optimizer state with Orbax.

A checkpoint is one Orbax step directory in the layout Keras's
`OrbaxCheckpoint` callback writes (`<directory>/<step>/pytree` holding
`model.get_state_tree()`, `model_config` holding the model's JSON config), so
Keras's own `model.load_weights(directory)` and `keras.saving.load_model`
read it too. Every process writes only the array slices it owns. The plan,
the caller's metadata and the data-iterator state go in the step's custom
metadata under `"keras_autoshard"`.

Orbax writes a step into a temporary directory and renames it when complete;
`complete_steps` lists only steps that finished, so a save killed part way
leaves the previous checkpoint the latest. Restoring reads each array's
slices straight onto the target model's current shardings: any mesh shape,
any device count, or a single device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from keras_autoshard.checkpoint import torch_dcp
from keras_autoshard.checkpoint.sharded_load import weights_owner
from keras_autoshard.checkpoint.steps import (
    STATE_CHECKPOINTABLE,
    STEP_METADATA_FILE,
    TORCH_INFO_FILE,
    complete_steps,
    latest_step,
)
from keras_autoshard.compat import keras_saving
from keras_autoshard.errors import CheckpointError, PlanError
from keras_autoshard.plans.sharding_plan import ShardingPlan

logger = logging.getLogger(__name__)

METADATA_KEY = "keras_autoshard"
FORMAT_NAME = "keras-autoshard/checkpoint"
FORMAT_VERSION = 1
CONFIG_CHECKPOINTABLE = "model_config"


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


def custom_metadata(
    plan: ShardingPlan | None = None,
    metadata: Any = None,
    data_iterator_state: Any = None,
) -> dict[str, Any]:
    """The JSON stored in a step's custom metadata under `"keras_autoshard"`.

    Args:
        plan: The sharding plan the model runs under.
        metadata: Any JSON-serialisable value of the caller's.
        data_iterator_state: JSON-serialisable state of the input pipeline.

    Returns:
        `{"keras_autoshard": {...}}`, ready for Orbax's `custom_metadata`.
    """
    return {
        METADATA_KEY: {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "plan": plan.to_dict() if plan is not None else None,
            "metadata": metadata,
            "data_iterator_state": data_iterator_state,
        }
    }


def current_plan(plan: ShardingPlan | None = None) -> ShardingPlan | None:
    """`plan`, or else the plan of the active Keras distribution, if it has one."""
    if plan is not None:
        return plan
    import keras

    distribution = keras.distribution.distribution()
    try:
        return getattr(distribution, "plan", None)
    except PlanError:  # AutoShardDistribution before its first batch: no plan yet
        return None


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
    ocp = _orbax_api()
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

    expected = sum(local_shard_bytes(v) for v in _flatten(state_tree).values())
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
    ocp = _orbax_api()

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
    ocp = _orbax_api()
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


def saved_plan(record: Mapping[str, Any], file: str) -> ShardingPlan | None:
    """The plan in a checkpoint's keras-autoshard record (read from `file`).

    Returns:
        The plan; `None` when the checkpoint was saved without one.

    Raises:
        CheckpointError: a plan is stored but cannot be read, naming `file`.
    """
    plan_data = record.get("plan")
    if plan_data is None:
        return None
    try:
        return ShardingPlan.from_dict(plan_data)
    except (PlanError, KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(
            f"The sharding plan stored in {file} cannot be read "
            f"({type(error).__name__}: {error}): the file is damaged, or was "
            "written by another keras-autoshard version. Restore another step."
        ) from error


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

    ocp = _orbax_api()
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


def model_state_tree(model) -> dict[str, Any]:
    """`model.get_state_tree()`, also for models without an optimizer.

    Args:
        model: A built Keras model.

    Returns:
        Group name → nested dict of variable values (`jax.Array`), the groups
        being trainable, non-trainable, optimizer (when compiled) and metrics
        variables.
    """
    if getattr(model, "optimizer", None) is not None:
        return model.get_state_tree()
    groups = {
        "trainable_variables": model.trainable_variables,
        "non_trainable_variables": model.non_trainable_variables,
        "metrics_variables": model.metrics_variables,
    }
    return {
        name: keras_saving.nested_state_dict(model, variables)
        for name, variables in groups.items()
    }


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
    saved = _flatten(saved_tree)
    target = _flatten(target_tree)
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


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _model_config_json(model) -> str:
    try:
        return keras_saving.model_config_json(model)
    except Exception as error:
        raise CheckpointError(
            f"Model {model.name!r} cannot be serialised to a config ({error}). "
            "Implement get_config, or save with include_model_config=False."
        ) from error


def _orbax_api():
    """Orbax's checkpointing API, `orbax.checkpoint.v1`, which Keras's
    `OrbaxCheckpoint` callback uses too.

    Raises:
        ImportError: orbax-checkpoint is not installed.
    """
    try:
        import orbax.checkpoint
    except ImportError as error:
        raise ImportError(
            "Orbax checkpoints need the 'orbax-checkpoint' package: pip install "
            "'keras-autoshard[checkpoint]' (or orbax-checkpoint)."
        ) from error
    return orbax.checkpoint.v1
