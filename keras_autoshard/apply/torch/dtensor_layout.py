"""From plan specs to DTensor placements on a torch `DeviceMesh`."""

from __future__ import annotations

from collections.abc import Sequence

from keras_autoshard.plans.mesh import SpecEntry, entry_axes
from keras_autoshard.plans.sharding_plan import MeshSpec, PlanError
from keras_autoshard.runtime.torch_processes import (
    TorchSetupError,
    device_type,
    end_groups_at_exit,
    ensure_process_group,
)


def torch_device_mesh(mesh: MeshSpec):
    """A torch `DeviceMesh` with the plan's shape and axis names.

    Args:
        mesh: The plan's mesh; its size must equal the number of ranks.

    Returns:
        `torch.distributed.device_mesh.DeviceMesh`, ranks in row-major order
        (the same device order as the JAX mesh of the same shape).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ensure_process_group()
    world = dist.get_world_size()
    if mesh.device_count != world:
        raise TorchSetupError(
            f"Mesh {mesh.describe()} needs {mesh.device_count} ranks but "
            f"torchrun started {world}. Launch with --nproc-per-node "
            f"{mesh.device_count} (times the number of nodes), or plan for a "
            "mesh of that size."
        )
    device_mesh = init_device_mesh(
        device_type(), tuple(mesh.shape), mesh_dim_names=tuple(mesh.axis_names)
    )
    end_groups_at_exit(device_mesh)
    return device_mesh


def placements_for(spec: Sequence[SpecEntry], mesh: MeshSpec) -> list:
    """DTensor placements for a plan spec: one per mesh axis.

    A dim cut over several mesh axes takes `Shard(dim)` on each of them;
    DTensor cuts a dim mesh dim by mesh dim in mesh order, so the entry's
    axes must be in the mesh's order (the first major, as in JAX).

    Args:
        spec: Per tensor dimension, a mesh axis name, a tuple of them, or
            `None`.
        mesh: The mesh.

    Returns:
        `Shard(dim)` for the mesh axes the spec uses, `Replicate()` otherwise.

    Raises:
        PlanError: an entry names its axes against the mesh's order.

    Example:

    ```python
    placements_for((None, "model"), MeshSpec((2, 4), ("batch", "model")))
    # [Replicate(), Shard(dim=1)]
    placements_for((("batch", "model"), None), MeshSpec((2, 4), ("batch", "model")))
    # [Shard(dim=0), Shard(dim=0)]
    ```
    """
    from torch.distributed.tensor import Replicate, Shard

    for dim, entry in enumerate(spec):
        positions = [mesh.axis_names.index(axis) for axis in entry_axes(entry)]
        if positions != sorted(positions):
            raise PlanError(
                f"Spec {tuple(spec)} cuts dim {dim} over mesh axes {entry} in an "
                f"order other than the mesh's {mesh.axis_names}; DTensor cuts a "
                "dim over several mesh axes in mesh order only. Write the entry "
                f"as {tuple(sorted(entry, key=mesh.axis_names.index))}."
            )
    placements = []
    for axis in mesh.axis_names:
        dims = [dim for dim, entry in enumerate(spec) if axis in entry_axes(entry)]
        placements.append(Shard(dims[0]) if dims else Replicate())
    return placements


def batch_placements(mesh: MeshSpec, batch_axis: SpecEntry) -> list:
    """Placements of an input batch: split on `batch_axis`, else replicated."""
    return placements_for((batch_axis,), mesh)


def batch_mesh_dims(mesh: MeshSpec, batch_axis: SpecEntry) -> frozenset[int]:
    """Indices in the mesh of the axes the batch is split over."""
    return frozenset(mesh.axis_names.index(axis) for axis in entry_axes(batch_axis))


def batch_cut_on_batch_axis(value, batch_dims: frozenset[int]):
    """A layer output with its batch dimension cut over the batch axes only
    and no pending sum: over any other mesh axis, a cut of dimension 0 or a
    partial sum becomes a replica (other cuts, and values that are not
    DTensors, are left as they are).

    DTensor's propagation may cut activations' batch over the model axis (a
    reduce-scatter of a partial sum, say) while the masks derived from the
    inputs are cut over the batch axis only; keras 3.16 computes attention on
    the local blocks of its inputs, which must then be cut alike.

    Args:
        value: Anything a layer returns.
        batch_dims: Indices in the mesh of the batch axes (`batch_mesh_dims`).
    """
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor) or value.ndim == 0:
        return value
    placements = [
        Replicate()
        if index not in batch_dims and (placement.is_partial() or placement.is_shard(0))
        else placement
        for index, placement in enumerate(value.placements)
    ]
    if placements == list(value.placements):
        return value
    return value.redistribute(value.device_mesh, placements)
