"""User rules: regular expressions on variable paths mapped to specs."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from keras_autoshard.plans.mesh import Spec, SpecEntry, normalize_spec
from keras_autoshard.plans.sharding_plan import (
    ActivationLayout,
    MeshSpec,
    PlanError,
    ShardingPlan,
    VariableSharding,
)
from keras_autoshard.plans.validation import validate_plan_structure


def match_rules(
    paths: Sequence[str], rules: Mapping[str, Spec]
) -> dict[str, tuple[str, tuple[SpecEntry, ...]]]:
    """Which rule applies to which path.

    A rule applies when its pattern fully matches the path (as in Keras's
    `LayoutMap`). A path matched by two rules, or a rule that matches no path,
    is an error: both mean the rules do not say what their author meant.

    Args:
        paths: Variable paths.
        rules: Regular expression → spec.

    Returns:
        path → (pattern, spec) for every matched path.
    """
    compiled = {pattern: re.compile(pattern) for pattern in rules}
    matched: dict[str, tuple[str, tuple[SpecEntry, ...]]] = {}
    used = set()
    for path in paths:
        hits = [p for p, regex in compiled.items() if regex.fullmatch(path)]
        if len(hits) > 1:
            raise PlanError(
                f"Variable {path!r} matches several rules {hits}; make the "
                "patterns exclusive so each variable matches at most one."
            )
        if hits:
            matched[path] = (hits[0], normalize_spec(rules[hits[0]]))
            used.add(hits[0])
    unused = [p for p in rules if p not in used]
    if unused:
        example = ", ".join(repr(p) for p in list(paths)[:3])
        raise PlanError(
            f"Rule(s) {unused} match no variable of the model. Patterns must "
            f"fully match variable paths such as {example}. Fix or remove them."
        )
    return matched


def plan_from_rules(
    variables: Sequence,
    mesh: MeshSpec,
    rules: Mapping[str, Spec],
    batch_axis: SpecEntry,
    roles: Mapping[str, Sequence[str | None]] | None = None,
    activations: Sequence[ActivationLayout] = (),
    check_structure: bool = True,
) -> ShardingPlan:
    """A plan that applies `rules` and replicates every other variable.

    Args:
        variables: Keras variables (with `path`, `shape`, `dtype`).
        mesh: The mesh.
        rules: Regular expression on the path → spec (per dimension a mesh
            axis name, a tuple of them, or `None`).
        batch_axis: Mesh axis (or tuple of mesh axes) for the batch
            dimension, or `None`.
        roles: Optional regular expression → logical roles per dimension.
        activations: Layer-output layouts to add.
        check_structure: Validate specs against the mesh (divisibility,
            axis names) before returning.

    Returns:
        The `ShardingPlan` (validated unless `check_structure` is False).

    Example:

    ```python
    plan = plan_from_rules(model.variables, MeshSpec((2, 4), ("batch", "model")),
                           {".*up/kernel": (None, "model")}, batch_axis="batch")
    ```
    """
    paths = [v.path for v in variables]
    matched = match_rules(paths, rules)
    matched_roles = {}
    if roles:
        for path, (_, role) in _match_roles(paths, roles).items():
            matched_roles[path] = role
    entries = []
    for v in variables:
        shape = tuple(int(s) for s in v.shape)
        pattern, spec = matched.get(v.path, ("", (None,) * len(shape)))
        entries.append(
            VariableSharding(
                path=v.path,
                shape=shape,
                dtype=str(v.dtype),
                spec=spec,
                roles=matched_roles.get(v.path, ()),
                reason=f"rule {pattern!r}" if pattern else "no rule: replicated",
            )
        )
    plan = ShardingPlan(
        mesh=mesh,
        variables=tuple(entries),
        batch_axis=batch_axis,
        activations=tuple(activations),
    )
    if check_structure:
        validate_plan_structure(plan)
    return plan


def _match_roles(paths, roles):
    compiled = {pattern: re.compile(pattern) for pattern in roles}
    result = {}
    for path in paths:
        for pattern, regex in compiled.items():
            if regex.fullmatch(path):
                result[path] = (pattern, tuple(roles[pattern]))
                break
    return result
