"""`MeshAxis`: a mesh axis as the search sees it (data, model or free; or
one axis spanning several), and the axes a plan on a mesh may cut over.
"""

from __future__ import annotations

import dataclasses
import math

from keras_autoshard.plans.mesh import DATA_AXIS_NAMES, MODEL_AXIS_NAMES, entry_text


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """A mesh axis the planner may shard over.

    Args:
        name: The mesh axis name.
        size: Devices along it.
        data_only: A data-parallel axis: it may shard only the batch (and
            parameter storage, FSDP-style), never a model dimension. Axes
            named batch/data/dp/fsdp/replica are data axes.
        model_only: A tensor-parallel axis: it never shards the batch. Axes
            named model/tensor/tp/mp are model axes. Other names: free.
        members: For an axis spanning several mesh axes (`spanning`), their
            names, the first major; empty for a mesh axis.
    """

    name: str
    size: int
    data_only: bool = False
    model_only: bool = False
    members: tuple[str, ...] = ()

    @classmethod
    def named(cls, name: str, size: int) -> MeshAxis:
        lowered = name.lower()
        return cls(
            name,
            size,
            data_only=lowered in DATA_AXIS_NAMES,
            model_only=lowered in MODEL_AXIS_NAMES,
        )

    @classmethod
    def spanning(cls, axes: tuple[MeshAxis, ...]) -> MeshAxis:
        """One axis over all of `axes` at once (the first major): a dim it
        cuts is cut over every device of their product. Named as a plan
        spells the spec entry (`"batch+model"`); it cuts only the batch."""
        return cls(
            entry_text(tuple(a.name for a in axes)),
            math.prod(a.size for a in axes),
            members=tuple(a.name for a in axes),
        )

    @property
    def covers(self) -> tuple[str, ...]:
        """The mesh axes a cut over this axis uses (itself, or its members)."""
        return self.members or (self.name,)


def mesh_axes(axes: tuple[MeshAxis, ...]) -> tuple[MeshAxis, ...]:
    """The axes of the mesh itself (no spanning axis)."""
    return tuple(a for a in axes if not a.members)


def planning_axes(mesh) -> tuple[MeshAxis, ...]:
    """The axes a plan on `mesh` (a `MeshSpec`) may cut over: the mesh's
    axes of size > 1, and where there are several, one axis spanning all of
    them (the batch cut over every device)."""
    axes = tuple(
        MeshAxis.named(name, size)
        for name, size in zip(mesh.axis_names, mesh.shape)
        if size > 1
    )
    return axes + ((MeshAxis.spanning(axes),) if len(axes) > 1 else ())


def covering(axes: tuple[MeshAxis, ...], name: str) -> tuple[MeshAxis, ...]:
    """The axes of `axes` whose cut uses mesh axis `name` (it and spanning
    axes over it)."""
    return tuple(a for a in axes if name in a.covers)
