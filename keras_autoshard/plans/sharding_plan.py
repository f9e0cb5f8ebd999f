"""`ShardingPlan`: which mesh axis shards which dimension of which tensor.

A plan is plain, immutable data. It names the mesh (shape and axis names),
gives every model variable a partition spec (per dimension a mesh axis name,
a tuple of them, or `None`) with the logical role of each dimension where
known, and lists activation layouts (layer outputs) that pin the
partitioner's choices. It can be printed, saved as JSON, turned into a Keras
`LayoutMap`, and checked against a model. It does not import any backend.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from keras_autoshard.errors import PlanError  # noqa: F401
from keras_autoshard.plans.estimate import PlanEstimate  # noqa: F401
from keras_autoshard.plans.identity import key_path, unique_variables  # noqa: F401
from keras_autoshard.plans.layouts import ActivationLayout, VariableSharding  # noqa: F401
from keras_autoshard.plans.mesh import (  # noqa: F401
    MeshSpec,
    SpecEntry,
    dtype_itemsize,
    entry_text,
    normalize_entry,
)

FORMAT_NAME = "keras-autoshard/sharding-plan"
FORMAT_VERSION = 1
_NUMBER = re.compile(r"(\d+)")


def path_order(path: str) -> tuple:
    """Sort key that orders paths as a person reads them: the numbers Keras
    appends to layer names compare as numbers (`dense_9` before `dense_10`),
    so every copy of a repeated block lists its variables in one order.

    Args:
        path: A variable or layer path such as `"block_10/dense_21/kernel"`.

    Returns:
        A tuple of text and integer parts.

    Example:

    ```python
    sorted(["dense_10/kernel", "dense_9/kernel"], key=path_order)
    # ["dense_9/kernel", "dense_10/kernel"]
    ```
    """
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in _NUMBER.split(path)
    )


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Plain-data sharding plan for one model on one mesh shape.

    Args:
        mesh: The mesh the plan is for.
        variables: One `VariableSharding` per model variable.
        batch_axis: Mesh axis that splits the batch dimension of the inputs,
            a tuple of mesh axes (the batch cut over all of them, the first
            major), or `None` to replicate inputs.
        activations: Layout constraints on layer outputs.
        notes: Planner remarks a person should read (replicated KV heads,
            vocabularies that do not divide, ...).
        estimate: The planner's per-device memory and per-step communication
            figures (`PlanEstimate`), or `None` for a plan written by hand.
        rematerialize: Names of the layers whose calls the backward pass
            recomputes (`keras_autoshard.rematerialize(model, plan)`;
            `AutoShardDistribution` and `TensorParallel` apply it).
        gradient_accumulation_steps: Micro-batches the planned batch is fed
            in, one per step (set the optimizer's
            `gradient_accumulation_steps` to it); 1 for none.

    Example:

    ```python
    plan = ShardingPlan(
        mesh=MeshSpec((2, 4), ("batch", "model")),
        batch_axis="batch",
        variables=(
            VariableSharding("up/kernel", (64, 256), "float32", (None, "model")),
            VariableSharding("down/kernel", (256, 64), "float32", ("model", None)),
        ),
    )
    print(plan.summary())
    plan2 = ShardingPlan.from_json(plan.to_json())
    assert plan2 == plan
    ```
    """

    mesh: MeshSpec
    variables: tuple[VariableSharding, ...]
    batch_axis: SpecEntry = None
    activations: tuple[ActivationLayout, ...] = ()
    notes: tuple[str, ...] = ()
    estimate: PlanEstimate | None = dataclasses.field(default=None, compare=False)
    rematerialize: tuple[str, ...] = ()
    gradient_accumulation_steps: int = 1

    def __post_init__(self):
        variables = tuple(sorted(self.variables, key=lambda v: path_order(v.path)))
        paths = [v.path for v in variables]
        duplicates = sorted({p for p in paths if paths.count(p) > 1})
        if duplicates:
            raise PlanError(f"Plan lists these variables twice: {duplicates}.")
        object.__setattr__(self, "variables", variables)
        activations = tuple(sorted(self.activations, key=lambda a: path_order(a.path)))
        object.__setattr__(self, "activations", activations)
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "batch_axis", normalize_entry(self.batch_axis))
        if self.batch_axis is not None:
            self.mesh.axis_size(self.batch_axis)

    # ----------------------------------------------------------------- lookups
    def variable(self, path: str) -> VariableSharding:
        """The `VariableSharding` for `path`; raises `KeyError` naming it."""
        found = self._by_path().get(path)
        if found is None:
            raise KeyError(f"Variable {path!r} is not in the plan.")
        return found

    def get(self, path: str) -> VariableSharding | None:
        """The `VariableSharding` for `path`, or `None` if the plan lacks it."""
        return self._by_path().get(path)

    def activation(self, path: str) -> ActivationLayout | None:
        """The layout pinned on layer output `path`, or `None`."""
        for layout in self.activations:
            if layout.path == path:
                return layout
        return None

    def _by_path(self) -> dict[str, VariableSharding]:
        # Frozen dataclass: cache the index on first use.
        index = self.__dict__.get("_index")
        if index is None:
            index = {v.path: v for v in self.variables}
            object.__setattr__(self, "_index", index)
        return index

    # ------------------------------------------------------------------ bytes
    def bytes_per_device(self) -> int:
        """Bytes of all planned variables held by each device."""
        return sum(v.bytes_per_device(self.mesh) for v in self.variables)

    def total_bytes(self) -> int:
        """Bytes of all planned variables, unsharded."""
        return sum(v.total_bytes for v in self.variables)

    # ---------------------------------------------------------------- editing
    def replace_specs(
        self, specs: Mapping[str, Sequence[SpecEntry]], reason: str = "user rule"
    ) -> ShardingPlan:
        """A copy of this plan with the given variables' specs replaced."""
        unknown = sorted(set(specs) - set(self._by_path()))
        if unknown:
            raise PlanError(f"Cannot replace specs of variables not in plan: {unknown}")
        variables = tuple(
            dataclasses.replace(v, spec=tuple(specs[v.path]), reason=reason)
            if v.path in specs
            else v
            for v in self.variables
        )
        return dataclasses.replace(self, variables=variables)

    # ------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (the form `to_json` writes)."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "mesh": {
                "shape": list(self.mesh.shape),
                "axis_names": list(self.mesh.axis_names),
            },
            "batch_axis": _json_entry(self.batch_axis),
            "variables": [
                {
                    "path": v.path,
                    "shape": list(v.shape),
                    "dtype": v.dtype,
                    "spec": [_json_entry(entry) for entry in v.spec],
                    "roles": list(v.roles),
                    "reason": v.reason,
                }
                for v in self.variables
            ],
            "activations": [
                {"path": a.path, "spec": [_json_entry(e) for e in a.spec]}
                for a in self.activations
            ],
            "notes": list(self.notes),
            "rematerialize": list(self.rematerialize),
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "estimate": None if self.estimate is None else self.estimate.to_dict(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Stable JSON text (sorted variables, fixed key order)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardingPlan:
        """Read a plan from `to_dict`'s form; `PlanError` for another format."""
        if data.get("format") != FORMAT_NAME:
            raise PlanError(
                f"Not a sharding plan: format is {data.get('format')!r}, "
                f"expected {FORMAT_NAME!r}."
            )
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise PlanError(
                f"Sharding plan format version {version} is not supported by "
                f"this keras-autoshard (reads version {FORMAT_VERSION}). "
                "Re-create the plan with this version."
            )
        mesh = MeshSpec(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"]))
        variables = tuple(
            VariableSharding(
                path=v["path"],
                shape=tuple(v["shape"]),
                dtype=v["dtype"],
                spec=tuple(v["spec"]),
                roles=tuple(v.get("roles") or ()),
                reason=v.get("reason", ""),
            )
            for v in data["variables"]
        )
        activations = tuple(
            ActivationLayout(a["path"], tuple(a["spec"]))
            for a in data.get("activations", ())
        )
        return cls(
            mesh=mesh,
            variables=variables,
            batch_axis=data.get("batch_axis"),
            activations=activations,
            notes=tuple(data.get("notes", ())),
            rematerialize=tuple(data.get("rematerialize") or ()),
            gradient_accumulation_steps=int(data.get("gradient_accumulation_steps", 1)),
            estimate=(
                PlanEstimate.from_dict(data["estimate"])
                if data.get("estimate")
                else None
            ),
        )

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """Read a plan from `to_json`'s text."""
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        """Write the plan as JSON to `path`."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> ShardingPlan:
        """Read a plan written by `save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    # ------------------------------------------------------------ conversions
    def to_layout_map(self, device_mesh):
        """A Keras `LayoutMap` with one exact-path entry per variable/activation.

        Args:
            device_mesh: A `keras.distribution.DeviceMesh` whose shape and axis
                names match the plan's mesh.

        Returns:
            A `keras.distribution.LayoutMap`.
        """
        from keras.distribution import LayoutMap

        from keras_autoshard.compat.keras_layouts import tensor_layout

        check_mesh_matches(self.mesh, device_mesh)
        layout_map = LayoutMap(device_mesh)
        specs_by_path: dict[str, set] = {}
        for v in self.variables:
            specs_by_path.setdefault(key_path(v.path), set()).add(v.spec)
        for path, specs in specs_by_path.items():
            if len(specs) > 1:
                raise PlanError(
                    f"Variables sharing the path {path!r} have different specs "
                    f"{sorted(specs, key=str)} in this plan; a Keras LayoutMap "
                    "keys layouts by path and cannot hold them. Apply the plan "
                    "with keras_autoshard.PlanDistribution(plan), which tells "
                    "them apart by their order in the model."
                )
            layout_map[re.escape(path)] = tensor_layout(specs.pop(), device_mesh)
        for a in self.activations:
            layout_map[re.escape(a.path)] = tensor_layout(a.spec, device_mesh)
        return layout_map

    def summary(self, max_rows: int | None = None) -> str:
        """The plan as a text table (path, shape, spec, roles, bytes per device)."""
        from keras_autoshard.plans.plan_table import render_plan_table

        return render_plan_table(self, max_rows=max_rows)

    def explain(self) -> str:
        """Why each variable is cut as it is: its roles and the deciding cost."""
        batch = None if self.batch_axis is None else entry_text(self.batch_axis)
        lines = [f"Plan on mesh {self.mesh.describe()}, batch on {batch!r}"]
        if self.estimate is not None and self.estimate.search is not None:
            lines.append(f"search: {self.estimate.search}")
        for v in self.variables:
            roles = ", ".join(r or "?" for r in v.roles)
            spec = ", ".join(entry_text(entry) for entry in v.spec)
            lines.append(f"{v.path} [{roles}] -> ({spec}): {v.reason or 'no reason'}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def validate(self, model) -> None:
        """Check that this plan fits `model`; raise `PlanError` listing each problem.

        Checks: every model variable is in the plan with the same shape, no
        plan entry names a variable the model lacks, every spec has one entry
        per dimension, names existing mesh axes, uses no mesh axis twice, and
        cuts only dimensions divisible by their mesh axis size.

        Args:
            model: A built `keras.Model` (or anything with `.variables`).
        """
        from keras_autoshard.plans.validation import validate_plan_against_variables

        validate_plan_against_variables(self, unique_variables(model.variables))


def _json_entry(entry: SpecEntry) -> str | list[str] | None:
    """A spec entry as JSON holds it (a list for several axes)."""
    return list(entry) if isinstance(entry, tuple) else entry


def check_mesh_matches(mesh: MeshSpec, device_mesh) -> None:
    """Raise `PlanError` if a Keras `DeviceMesh` differs from the plan's mesh."""
    shape = tuple(device_mesh.shape)
    names = tuple(device_mesh.axis_names)
    if shape != mesh.shape or names != mesh.axis_names:
        raise PlanError(
            f"The plan is for mesh {mesh.describe()} but the device mesh is "
            f"{' x '.join(f'{n}={s}' for n, s in zip(names, shape))}. Re-plan "
            "for this mesh, or build the DeviceMesh with the plan's shape and "
            "axis names."
        )
