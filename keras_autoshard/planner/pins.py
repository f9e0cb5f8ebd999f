"""Choices fixed before the search, from user rules.

The rules are matched to the variables once per plan (`match_variables`);
on each mesh they are checked against the variables' shapes and turned into
`Pins` (`pins_on_mesh`). Every error names the rule, variable, shape, dim,
mesh axis and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from keras_autoshard.errors import PlanError
from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.plans.mesh import MeshSpec, entry_axes, spec_axes
from keras_autoshard.plans.rules import Spec, SpecEntry, match_rules

if TYPE_CHECKING:
    from keras_autoshard.trace.tracer import VariableInfo


@dataclasses.dataclass(frozen=True)
class Pins:
    """Choices fixed before the search (from user rules).

    Args:
        class_axis: Class id → mesh axis name, or None to forbid sharding it.
        fsdp: Parameter name → ((dim, axis), ...) storage sharding to force.
        no_fsdp: Parameter names whose storage must follow `class_axis` only.
    """

    class_axis: Mapping[int, str | None] = dataclasses.field(default_factory=dict)
    fsdp: Mapping[str, tuple[tuple[int, str], ...]] = dataclasses.field(
        default_factory=dict
    )
    no_fsdp: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class RuleMatch:
    """One variable a user rule pins.

    Args:
        rule: The rule's pattern.
        spec: Its spec, one entry per dim of the variable once checked.
        shape: The variable's shape.
    """

    rule: str
    spec: tuple[SpecEntry, ...]
    shape: tuple[int, ...]


def match_variables(
    variables: Sequence[VariableInfo], rules: Mapping[str, Spec] | None
) -> dict[str, RuleMatch]:
    """The variables the rules pin, by path (`plans.rules.match_rules`).

    Args:
        variables: The traced model's variables.
        rules: Regular expression on variable path → spec, or `None`.

    Returns:
        Path → `RuleMatch` (empty without rules).

    Raises:
        PlanError: When a rule matches nothing, or a variable several rules,
            or a spec's length is not the variable's rank.

    Example:
        `match_variables(traced.variables, {"dense/kernel": (None, "model")})`
    """
    if not rules:
        return {}
    shapes = {v.path: tuple(v.shape) for v in variables}
    matched = match_rules(list(shapes), rules)
    matches = {
        path: RuleMatch(rule, tuple(spec), shapes[path])
        for path, (rule, spec) in matched.items()
    }
    for path, match in sorted(matches.items()):
        if len(match.spec) != len(match.shape):
            raise PlanError(
                f"{_where(path, match)}: the spec has {len(match.spec)} entries, "
                f"the variable {len(match.shape)} dims. Give one mesh axis or None "
                "per dim."
            )
    return matches


def pinned_specs(matches: Mapping[str, RuleMatch]) -> dict[str, tuple]:
    """Path → spec of every pinned variable, as the plan stores it."""
    return {path: match.spec for path, match in matches.items()}


def pins_on_mesh(
    graph: AxisGraph, matches: Mapping[str, RuleMatch], mesh: MeshSpec
) -> Pins:
    """The search's `Pins` on `mesh`, every rule checked against it first.

    Args:
        graph: The model's axis graph.
        matches: The rules' matches (`match_variables`).
        mesh: The mesh searched.

    Returns:
        The classes, storage cuts and unpinnable storage the rules fix.

    Raises:
        PlanError: When a rule's mesh axis is not in `mesh`, cuts two dims,
            does not divide its dim, or rules disagree on a tensor axis.
    """
    _check_on_mesh(matches, mesh)
    class_axis: dict[int, str | None] = {}
    fsdp: dict[str, list[tuple[int, str]]] = {}
    for path, match in matches.items():
        tensor = graph.params_by_path.get(path)
        if tensor is None:
            continue
        for dim, axis in enumerate(match.spec):
            if isinstance(axis, tuple):
                raise PlanError(
                    f"Rule for {path!r} cuts dim {dim} over several mesh axes "
                    f"{axis}; the planner takes one mesh axis per dim in rules "
                    "so far. Give the whole plan by rules instead "
                    "(keras_autoshard.plans.rules.plan_from_rules), or one axis."
                )
            cls = tensor.dim_classes[dim]
            if cls is None:
                if axis is not None:
                    raise PlanError(
                        f"Rule shards dim {dim} of {path!r} (size 1) on {axis!r}."
                    )
                continue
            shardable = graph.classes[cls].unshardable_reason is None
            if axis is None or not shardable:
                if axis is not None:
                    fsdp.setdefault(path, []).append((dim, axis))
                elif cls not in class_axis:
                    class_axis[cls] = None
                continue
            previous = class_axis.get(cls, axis)
            if previous != axis:
                raise PlanError(
                    f"Rules disagree: {path!r} dim {dim} on {axis!r}, but another "
                    f"rule puts the same tensor axis on {previous!r} (they must "
                    "match, the computation couples them)."
                )
            class_axis[cls] = axis
    return Pins(
        class_axis=class_axis,
        fsdp={k: tuple(v) for k, v in fsdp.items()},
        no_fsdp=frozenset(matches),
    )


def _where(path: str, match: RuleMatch) -> str:
    return f"Rule {match.rule!r} (spec {match.spec}) on variable {path!r} {match.shape}"


def _check_on_mesh(matches: Mapping[str, RuleMatch], mesh: MeshSpec) -> None:
    """Every rule's spec fits its variables on `mesh`, before any search."""
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    for path, match in sorted(matches.items()):
        where = _where(path, match)
        named = spec_axes(match.spec)
        for axis in named:
            if axis not in sizes:
                raise PlanError(
                    f"{where}: mesh axis {axis!r} is not in the mesh {mesh.describe()}."
                )
        if len(set(named)) != len(named):
            raise PlanError(f"{where}: a mesh axis may cut only one dim of a tensor.")
        for dim, entry in enumerate(match.spec):
            size = mesh.axis_size(entry_axes(entry))
            if match.shape[dim] % size:
                axes = " x ".join(f"{a!r}" for a in entry_axes(entry))
                raise PlanError(
                    f"{where}: dim {dim} has size {match.shape[dim]}, which mesh axis "
                    f"{axes} (size {size}) does not divide. Cut another "
                    "dim, use a mesh axis that divides it, or pad the layer to "
                    f"a multiple of {size}."
                )
