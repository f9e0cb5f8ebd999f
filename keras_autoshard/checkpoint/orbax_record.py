"""What a keras-autoshard Orbax checkpoint step holds, and Orbax's API.

A checkpoint is one Orbax step directory in the layout Keras's
`OrbaxCheckpoint` callback writes (`<directory>/<step>/pytree` holding
`model.get_state_tree()`, `model_config` holding the model's JSON config), so
Keras's own `model.load_weights(directory)` and `keras.saving.load_model`
read it too. The plan, the caller's metadata and the data-iterator state go
in the step's custom metadata under `"keras_autoshard"`.

This module holds that record (`custom_metadata` writes it, `saved_plan`
reads its plan back), the state tree saved (`model_state_tree`), and the
Orbax API both `orbax_save` and `orbax_restore` use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keras_autoshard.compat import keras_saving
from keras_autoshard.errors import CheckpointError, PlanError
from keras_autoshard.plans.sharding_plan import ShardingPlan

METADATA_KEY = "keras_autoshard"
FORMAT_NAME = "keras-autoshard/checkpoint"
FORMAT_VERSION = 1
CONFIG_CHECKPOINTABLE = "model_config"


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


def flatten_tree(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_tree(value, name))
        else:
            flat[name] = value
    return flat


def orbax_api():
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
