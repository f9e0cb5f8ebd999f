"""Planning under the TensorFlow backend: the JAX planner, in a subprocess.

The planner reads a model's graph by tracing it with JAX, which a Keras model
on TensorFlow cannot do (Keras runs one backend per process). So, as for the
PyTorch backend, the model is serialised, a `KERAS_BACKEND=jax` subprocess
rebuilds it abstractly (shapes only, no weights) and plans it, and the plan
(JSON) comes back, renamed onto the local model's variable paths. The result
is the plan JAX makes for the same model and mesh.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import keras

from keras_autoshard.planner.subprocess_planning import (
    plan_from_worker_result,
    planning_request,
    run_plan_worker,
)
from keras_autoshard.plans.rules import Spec
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan


def plan_for_tensorflow(
    model: keras.Model,
    device_mesh: MeshSpec,
    sample_input,
    memory_budget: int | str | None = None,
    rules: Mapping[str, Spec] | None = None,
) -> ShardingPlan:
    """Plan a TensorFlow-backend model with the JAX planner, in a subprocess.

    Args:
        model: A built Keras model whose class can be serialised (functional
            and Sequential models, KerasHub backbones, registered subclasses).
        device_mesh: The mesh to plan for.
        sample_input: One global batch of inputs: arrays, `tf.Tensor`s, or
            anything with `shape` and `dtype` (dicts and lists of them too).
        memory_budget: Per-device bytes (a number, or a string such as
            `"16GiB"`) for parameters and optimizer state.
        rules: Regular expression on variable path → spec, pinned.

    Returns:
        The plan, with the local model's variable paths.

    Raises:
        PlanError: the model cannot be serialised or planned; the message
            says why and how to plan it under JAX instead.

    Example:

    ```python
    # KERAS_BACKEND=tensorflow
    plan = plan_for_tensorflow(model, MeshSpec((2, 1), ("batch", "model")), x)
    plan == keras_autoshard.plan(model_built_under_jax, mesh, x)   # True
    ```
    """
    request = planning_request(
        model, device_mesh, input_shapes(sample_input), memory_budget, rules
    )
    return plan_from_worker_result(run_plan_worker(request), model)


def input_shapes(sample_input):
    """Shapes and Keras dtype names of a batch (TensorFlow dtypes included)."""
    return keras.tree.map_structure(
        lambda value: types.SimpleNamespace(
            shape=tuple(int(s) for s in value.shape),
            dtype=keras.backend.standardize_dtype(value.dtype),
        ),
        sample_input,
    )
