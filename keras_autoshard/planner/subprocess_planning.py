"""Plan a model of any Keras backend with the JAX planner, in a subprocess.

Keras runs one backend per process, and the planner traces with JAX. So a
model built under PyTorch or TensorFlow is serialised
(`keras.saving.serialize_keras_object`), a `KERAS_BACKEND=jax` subprocess
(`keras_autoshard.planner.planning_worker`) rebuilds it abstractly (no
weights) and plans it, and the plan (JSON) comes back. It is then aligned
with the local model's variables by position and shape, since auto-numbered
layer names may differ between processes. The result is the plan JAX itself
would make for the same model and mesh. The backends decide who runs the
subprocess (under torchrun: rank 0, the plan shared through the rendezvous
store).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import keras

from keras_autoshard.compat import keras_private
from keras_autoshard.plans.rules import Spec
from keras_autoshard.plans.sharding_plan import (
    ActivationLayout,
    MeshSpec,
    PlanError,
    ShardingPlan,
    unique_variables,
)
from keras_autoshard.runtime.devices import flags_with_device_count

PLANNING_TIMEOUT_S = 600


def planning_request(
    model: keras.Model,
    device_mesh: MeshSpec,
    sample_input,
    memory_budget: int | str | None = None,
    rules: Mapping[str, Spec] | None = None,
    batch_over_model_axes: bool = True,
) -> dict[str, Any]:
    """What the JAX planning subprocess needs, as JSON-able data.

    Used by every backend that plans in a JAX subprocess (PyTorch, TensorFlow).

    Args:
        model: A built, serialisable Keras model.
        device_mesh: The mesh to plan for.
        sample_input: One global batch (anything with `shape` and a dtype
            whose name, without a `torch.` prefix, Keras knows).
        memory_budget: Per-device bytes (a number, or a string such as
            `"16GiB"`) for parameters and optimizer state.
        rules: Regular expression on variable path → spec, pinned.
        batch_over_model_axes: `plan()`'s.

    Returns:
        The request for `run_plan_worker`.
    """
    # The planner needs the architecture only; a compiled model's optimizer
    # would be rebuilt in the worker's shapes-only build, where it cannot be.
    architecture = _serialized(model)
    architecture.pop("compile_config", None)
    return {
        "model": architecture,
        "modules": sorted(_layer_modules(model)),
        "mesh": {
            "shape": list(device_mesh.shape),
            "axes": list(device_mesh.axis_names),
        },
        "inputs": encode_input_shapes(sample_input),
        "memory_budget": memory_budget,
        "rules": {k: list(v) for k, v in (rules or {}).items()},
        "batch_over_model_axes": batch_over_model_axes,
    }


def plan_from_worker_result(result: dict[str, Any], model: keras.Model) -> ShardingPlan:
    """The worker's plan under `model`'s paths, or its error as a `PlanError`."""
    if "error" in result:
        raise PlanError(result["error"])
    plan = ShardingPlan.from_json(result["plan"])
    return align_plan(plan, result["paths"], model)


def run_plan_worker(request: dict[str, Any]) -> dict[str, Any]:
    """Run the planner in a JAX subprocess; its answer or an error message."""
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    device_count = math.prod(request["mesh"]["shape"])
    # The caller's other XLA flags (a dump folder, compiler options) apply
    # to the worker too; only the device count is the worker's own.
    env["XLA_FLAGS"] = flags_with_device_count(env.get("XLA_FLAGS", ""), device_count)
    env["JAX_PLATFORMS"] = "cpu"
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "keras_autoshard.planner.planning_worker"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            env=env,
            timeout=PLANNING_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"Planning took over {PLANNING_TIMEOUT_S} s and was stopped."}
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        tail = "\n".join(completed.stderr.strip().splitlines()[-15:])
        return {
            "error": "The JAX planning subprocess failed "
            f"(exit {completed.returncode}):\n{tail}"
        }
    return json.loads(lines[-1])


def align_plan(
    plan: ShardingPlan, planned_paths: Sequence[str], model: keras.Model
) -> ShardingPlan:
    """The plan renamed to `model`'s variable paths, matched by position.

    Args:
        plan: A plan made for a copy of `model` in another process.
        planned_paths: That copy's variable paths, in `model.variables` order.
        model: The local model.

    Returns:
        The same specs under the local paths.

    Raises:
        PlanError: the two models differ (count or shape), naming the first
            variable that differs.
    """
    local = unique_variables(model.variables)
    if len(local) != len(planned_paths):
        raise PlanError(
            f"The planned model has {len(planned_paths)} variables but the local "
            f"model has {len(local)}: the serialised config does not rebuild the "
            "same model. Plan it under JAX and pass the plan explicitly."
        )
    renamed = []
    for variable, planned_path in zip(local, planned_paths):
        entry = plan.variable(planned_path)
        if tuple(entry.shape) != tuple(variable.shape):
            raise PlanError(
                f"Variable {variable.path!r} has shape {tuple(variable.shape)} but "
                f"its planned counterpart {planned_path!r} has {entry.shape}: the "
                "models differ. Plan it under JAX and pass the plan explicitly."
            )
        renamed.append(dataclasses.replace(entry, path=variable.path))
    return dataclasses.replace(
        plan,
        variables=tuple(renamed),
        activations=_renamed_activations(plan, planned_paths, local),
    )


def _renamed_activations(
    plan: ShardingPlan, planned_paths: Sequence[str], local
) -> tuple[ActivationLayout, ...]:
    """Activation layouts moved onto the local layers' paths.

    A layout names a layer's output (`"<layer path>/output"`); the layer is
    found through the variables it owns, paired by position like the
    variables themselves. A layout of a layer without variables keeps its
    path.
    """
    layers = {
        planned.rpartition("/")[0]: variable.path.rpartition("/")[0]
        for planned, variable in zip(planned_paths, local)
    }
    renamed = []
    for layout in plan.activations:
        layer, _, leaf = layout.path.rpartition("/")
        renamed.append(
            ActivationLayout(f"{layers.get(layer, layer)}/{leaf}", layout.spec)
        )
    return tuple(renamed)


def encode_input_shapes(sample_input) -> Any:
    """Shapes and dtypes of a batch as JSON-able data (nested dicts/lists)."""
    if isinstance(sample_input, Mapping):
        return {"dict": {k: encode_input_shapes(v) for k, v in sample_input.items()}}
    if isinstance(sample_input, (list, tuple)):
        return {"list": [encode_input_shapes(v) for v in sample_input]}
    shape = [int(s) for s in sample_input.shape]
    dtype = str(sample_input.dtype).removeprefix("torch.")
    return {"shape": shape, "dtype": dtype}


def _serialized(model: keras.Model) -> dict:
    try:
        config = keras.saving.serialize_keras_object(model)
        json.dumps(config)
    except Exception as error:  # noqa: BLE001 - any failure means "not serialisable"
        raise PlanError(
            f"{type(model).__name__} cannot be serialised for planning "
            f"({type(error).__name__}: {error}). Plan it under JAX with "
            "keras_autoshard.plan(...), save the plan as JSON and pass it "
            "(plan=ShardingPlan.load(path))."
        ) from error
    return config


def _layer_modules(model: keras.Model) -> set[str]:
    """Modules defining the model's layer classes, for the subprocess to import."""
    modules = set()
    for layer in keras_private.all_layers(model):
        module = type(layer).__module__
        if not module.startswith(("keras.", "keras_hub.", "__main__")):
            modules.add(module)
    return modules
