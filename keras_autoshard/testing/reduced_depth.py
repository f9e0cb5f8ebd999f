"""The same plan at fewer layers, and the line through its figures.

A real-size model's train step is compiled at a few depths of the same
widths, each sharded as the full depth's plan says (`restricted_plan`), and
its peak fitted as a line in the layer count (`fit_linear`) to reach the
full depth. The planner's estimate at those depths is for the same sharding
(`pinned_estimate`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np


def present_layers(layer_names: Sequence[str], paths: Sequence[str]) -> list[str]:
    """The layers of `layer_names` that own one of the variable `paths`."""
    return [
        name for name in layer_names if any(p.startswith(name + "/") for p in paths)
    ]


def restricted_plan(full_plan, paths: Sequence[str]):
    """The full plan for a shallower model of the same widths: its spec for
    each of `paths`, its rematerialized layers that own one of them, its
    micro-batches, batch axis and activation layouts (a layout of a layer
    the model lacks is never asked for); no estimate.

    Args:
        full_plan: The full depth's `ShardingPlan`.
        paths: The shallower model's variable paths.

    Returns:
        The `ShardingPlan`.

    Raises:
        KeyError: a path the full plan does not have.
    """
    return dataclasses.replace(
        full_plan,
        variables=tuple(full_plan.variable(path) for path in paths),
        rematerialize=tuple(present_layers(full_plan.rematerialize, paths)),
        notes=(),
        estimate=None,
    )


def check_same_levers(full_plan, plan) -> None:
    """Assert that `plan` rematerializes the full plan's layers it has, in
    the full plan's micro-batches, with its batch axis."""
    expected = present_layers(full_plan.rematerialize, [v.path for v in plan.variables])
    assert sorted(plan.rematerialize) == sorted(expected), (
        f"rematerialized {plan.rematerialize}, the full plan {expected}"
    )
    assert plan.gradient_accumulation_steps == full_plan.gradient_accumulation_steps
    assert plan.batch_axis == full_plan.batch_axis


def spec_differences(full_plan, plan) -> list[str]:
    """Each variable of `plan` whose spec is not the full plan's, in words."""
    return [
        f"{v.path} {tuple(v.spec)} (full plan {tuple(full_plan.variable(v.path).spec)})"
        for v in plan.variables
        if tuple(v.spec) != tuple(full_plan.variable(v.path).spec)
    ]


def pinned_estimate(builder, sharding_plan, sample_input, hardware: str):
    """The planner's estimate of a given plan, by planning the model with
    every variable pinned to the plan's spec and its levers asked for.

    Not through `plan(rules=...)`: a rule's axis on a dimension is read as
    the computation's cut there (FSDP storage only where the dimension
    cannot be cut at all), so the specs of a plan that stores weights cut
    (`embed` on `batch` in a kernel, on `model` in a LayerNorm scale) raise
    "Rules disagree" against the same dimension left whole elsewhere. Here
    a dimension class is computed on an axis where every pinned dimension of
    it has that axis and it is not a data axis (the planner computes a
    class on one axis, and every dimension of the class follows it); any
    other cut is storage. A class only ever stored cut on one non-data axis
    would be read as computed there: the check of the specs cannot see
    that, the estimate's activations would.

    Args:
        builder: Builds the model.
        sharding_plan: The plan (`restricted_plan`).
        sample_input: The inputs' global batch (`jax.ShapeDtypeStruct`s).
        hardware: The hardware profile planned for.

    Returns:
        `(estimate, planning_s, differences)`: `differences` names each
        variable the planner's plan stores otherwise (`spec_differences`):
        a pin fixes a storage cut on its axes, the search may add one on
        another.

    Raises:
        AssertionError: the planner's plan has other levers.
    """
    from keras_autoshard.graph.builder import build_axis_graph
    from keras_autoshard.planner.cost_model import PlannerOptions
    from keras_autoshard.planner.levers import choose_levers
    from keras_autoshard.planner.mesh_axis import planning_axes
    from keras_autoshard.planner.planner import _finish_plan
    from keras_autoshard.plans.hardware import hardware_profile
    from keras_autoshard.trace.tracer import build_abstract, trace_model

    start = time.perf_counter()
    traced = trace_model(build_abstract(builder), sample_input)
    profile = hardware_profile(hardware)
    # As `plan` does: the residuals the target's compiler keeps.
    graph = build_axis_graph(
        traced.closed_jaxpr, traced.invar_kinds, traced.inputs_made_in_step
    ).for_platform(profile.platform)
    mesh = sharding_plan.mesh
    options = PlannerOptions(
        memory_budget_bytes=profile.memory_budget_bytes,
        platform=profile.platform,
        hardware=profile,
        rematerialize=tuple(sharding_plan.rematerialize) or "none",
        gradient_accumulation_steps=sharding_plan.gradient_accumulation_steps,
    )
    axes = planning_axes(mesh)
    pins = _pins(graph, sharding_plan, {a.name for a in axes if a.data_only})
    chosen = choose_levers(graph, axes, mesh, options, pins)
    planned, _ = _finish_plan(graph, traced.variables, mesh, {}, chosen)
    check_same_levers(sharding_plan, planned)
    differences = spec_differences(sharding_plan, planned)
    return planned.estimate, time.perf_counter() - start, differences


def _pins(graph, sharding_plan, data_axes: set[str]):
    """The search's pins for every variable of the plan (see
    `pinned_estimate`): the computed axis of each class, the storage cuts."""
    from keras_autoshard.planner.pins import Pins

    params = {t.name: t for t in graph.params()}
    dims = [
        (variable.path, dim, params[variable.path].dim_classes[dim], axis)
        for variable in sharding_plan.variables
        if variable.path in params
        for dim, axis in enumerate(variable.spec)
    ]
    seen: dict[int, set[str | None]] = {}
    for _, _, cls, axis in dims:
        if cls is not None:
            seen.setdefault(cls, set()).add(axis)
    class_axis: dict[int, str | None] = {}
    for cls, axes in seen.items():
        (axis,) = axes if len(axes) == 1 else (None,)
        shardable = graph.classes[cls].unshardable_reason is None
        class_axis[cls] = axis if shardable and axis not in data_axes else None
    fsdp: dict[str, list[tuple[int, str]]] = {}
    for path, dim, cls, axis in dims:
        if axis is not None and (cls is None or class_axis[cls] != axis):
            fsdp.setdefault(path, []).append((dim, axis))
    return Pins(
        class_axis=class_axis,
        fsdp={path: tuple(cuts) for path, cuts in fsdp.items()},
        # The search leaves a parameter named here whole, forced cuts too.
        no_fsdp=frozenset(params) - set(fsdp),
    )


@dataclasses.dataclass(frozen=True)
class LinearFit:
    """`intercept + per_layer * layers`, least squares.

    Args:
        intercept: The value at zero layers.
        per_layer: Growth per layer.
        max_relative_residual: The largest |fit - measured| / measured.
    """

    intercept: float
    per_layer: float
    max_relative_residual: float

    def at(self, layers: float) -> float:
        return self.intercept + self.per_layer * layers


def fit_linear(layers: Sequence[float], values: Sequence[float]) -> LinearFit:
    """Least-squares line through `(layers, values)` (two points or more).

    Example:

    ```python
    fit_linear([2, 4, 8], [7, 11, 19]).at(80)  # 163.0
    ```
    """
    if len(layers) < 2:
        raise ValueError(f"A line needs two points or more, got {len(layers)}.")
    x = np.asarray(layers, dtype=float)
    y = np.asarray(values, dtype=float)
    per_layer, intercept = np.polyfit(x, y, 1)
    residual = np.abs(intercept + per_layer * x - y) / np.abs(y)
    return LinearFit(float(intercept), float(per_layer), float(residual.max()))
