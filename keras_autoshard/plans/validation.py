"""Checks that a `ShardingPlan` is well formed and fits a model's variables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from keras_autoshard.errors import PlanError
from keras_autoshard.plans.identity import variable_keys
from keras_autoshard.plans.layouts import VariableSharding
from keras_autoshard.plans.mesh import MeshSpec, entry_axes

if TYPE_CHECKING:
    from keras_autoshard.plans.sharding_plan import ShardingPlan


def spec_problems(
    path: str, shape: Sequence[int], spec: Sequence[str | None], mesh: MeshSpec
) -> list[str]:
    """Problems with one variable's spec on `mesh`, one sentence each.

    Args:
        path: Variable path, for the messages.
        shape: The variable's global shape.
        spec: Per dimension, a mesh axis name, a tuple of mesh axis names,
            or `None`.
        mesh: The mesh the spec refers to.

    Returns:
        A list of messages; empty when the spec is valid.
    """
    problems = []
    if len(spec) != len(shape):
        return [
            f"{path}: spec {tuple(spec)} has {len(spec)} entries but the variable "
            f"has shape {tuple(shape)} ({len(shape)} dims); give one mesh axis "
            "name, tuple of mesh axis names, or None per dimension."
        ]
    used: dict[str, int] = {}
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        unknown = [axis for axis in axes if axis not in mesh.axis_names]
        if unknown:
            problems.append(
                f"{path}: dim {dim} names mesh axis {unknown[0]!r}, which does not "
                f"exist; the mesh has axes {mesh.axis_names}. Use one of those "
                "or None."
            )
            continue
        for axis in axes:
            if axis in used:
                where = (
                    "twice in" if used[axis] == dim else f"both dim {used[axis]} and"
                )
                problems.append(
                    f"{path}: mesh axis {axis!r} shards {where} dim {dim}; a mesh "
                    "axis may shard at most one dimension of a tensor. Replicate "
                    "one of them (None)."
                )
            used[axis] = dim
        axis_size = mesh.axis_size(axes)
        if shape[dim] % axis_size == 0:
            continue
        if len(axes) == 1:
            named = f"mesh axis {axes[0]!r} of size {axis_size}"
            fix = f"a mesh axis whose size divides {shape[dim]}"
        else:
            sizes = [mesh.axis_size(a) for a in axes]
            named = f"mesh axes {axes} of sizes {sizes} (together {axis_size})"
            fix = f"mesh axes whose sizes multiply to a divisor of {shape[dim]}"
        problems.append(
            f"{path}: dim {dim} has size {shape[dim]}, which {named} does not "
            f"divide. Replicate that dim (None), shard another dim, or use {fix}."
        )
    return problems


def validate_plan_structure(plan: ShardingPlan) -> None:
    """Raise `PlanError` if any planned spec is malformed on the plan's mesh."""
    problems = []
    for v in plan.variables:
        problems += spec_problems(v.path, v.shape, v.spec, plan.mesh)
    _raise_if_any(problems)


def validate_plan_against_variables(plan: ShardingPlan, variables: Sequence) -> None:
    """Raise `PlanError` unless `plan` covers exactly these variables, validly.

    Args:
        plan: The plan to check.
        variables: Keras variables (each with `.path`, `.shape`, `.dtype`).
    """
    problems = []
    keys = variable_keys(variables)
    variables = [v for v in variables if id(v) in keys]
    model_keys = set(keys.values())
    planned: dict[str, VariableSharding] = {v.path: v for v in plan.variables}
    missing = [v for v in variables if keys[id(v)] not in planned]
    extra = sorted(set(planned) - model_keys)
    if missing and extra and len(extra) >= len(planned) // 2:
        problems.append(
            f"The plan looks like it is for another model: {len(missing)} of the "
            f"model's {len(variables)} variables are not in it (e.g. "
            f"{missing[0].path!r}) and {len(extra)} planned variables are not in "
            f"the model (e.g. {extra[0]!r}). Plan this model with "
            "keras_autoshard.plan(model, ...)."
        )
    else:
        for v in missing:
            problems.append(
                f"{v.path}: variable of shape {tuple(v.shape)} is not in the plan, "
                "so nothing says how to shard it. Re-plan the model or add an "
                "entry for it (a user rule, or VariableSharding with spec "
                f"{(None,) * len(v.shape)} to replicate it)."
            )
        for path in extra:
            problems.append(
                f"{path}: planned variable does not exist in the model. Remove it "
                "from the plan, or check that the model was built the same way "
                "as when the plan was made (layer names change the paths)."
            )
    for v in variables:
        entry = planned.get(keys[id(v)])
        if entry is None:
            continue
        shape = tuple(int(s) for s in v.shape)
        if shape != entry.shape:
            problems.append(
                f"{v.path}: the plan has shape {entry.shape} but the model "
                f"variable has shape {shape}. Re-plan this model."
            )
            continue
        problems += spec_problems(v.path, shape, entry.spec, plan.mesh)
    _raise_if_any(problems)


def _raise_if_any(problems: list[str]) -> None:
    if not problems:
        return
    head = f"Sharding plan is not valid ({len(problems)} problem(s)):"
    raise PlanError("\n".join([head] + [f"  - {p}" for p in problems]))
