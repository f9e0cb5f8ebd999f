"""Which mesh axes a set of device groups (or permute pairs) spans: device
ids are row-major positions in the mesh; axes of size 1 are never reported."""

from __future__ import annotations

import collections
import math

import numpy as np


def connected_components(
    pairs: tuple[tuple[int, int], ...],
) -> tuple[tuple[int, ...], ...]:
    """Returns the sorted connected components of a permute's pairs."""
    parent = {}

    def root(device: int) -> int:
        parent.setdefault(device, device)
        while parent[device] != device:
            parent[device] = parent[parent[device]]
            device = parent[device]
        return device

    for source, target in pairs:
        parent[root(source)] = root(target)
    components = collections.defaultdict(list)
    for device in sorted(parent):
        components[root(device)].append(device)
    return tuple(sorted(tuple(group) for group in components.values()))


def _mesh_coordinates(mesh_shape: tuple[int, ...]) -> np.ndarray:
    """Returns the row-major mesh coordinates of each device id."""
    return np.stack(np.unravel_index(np.arange(math.prod(mesh_shape)), mesh_shape), 1)


def mesh_axes_for_groups(
    groups: tuple[tuple[int, ...], ...],
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
) -> tuple[str, ...] | None:
    """Returns the mesh axes whose device classes are exactly `groups`.

    Args:
        groups: Groups of device ids.
        mesh_shape: Mesh shape; ids index its devices in row-major order.
        axis_names: Mesh axis names.

    Returns:
        The axes (in mesh order) such that every group is the set of devices
        sharing all coordinates outside them, or None when no subset of axes
        produces these groups.
    """
    num_devices = math.prod(mesh_shape)
    members = sorted(device for group in groups for device in group)
    if members != list(range(num_devices)):
        return None
    coordinates = _mesh_coordinates(mesh_shape)
    varying = set()
    for group in groups:
        group_coordinates = coordinates[list(group)]
        varying.update(np.flatnonzero(np.ptp(group_coordinates, axis=0) > 0).tolist())
    fixed = [dim for dim in range(len(mesh_shape)) if dim not in varying]
    expected = collections.defaultdict(set)
    for device in range(num_devices):
        expected[tuple(coordinates[device, fixed])].add(device)
    if {frozenset(group) for group in groups} != {
        frozenset(group) for group in expected.values()
    }:
        return None
    return tuple(axis_names[dim] for dim in sorted(varying))


def mesh_axes_for_pairs(
    pairs: tuple[tuple[int, int], ...],
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
) -> tuple[str, ...] | None:
    """Returns the mesh axes along which a permute's pairs move data.

    Args:
        pairs: `(source, target)` device ids.
        mesh_shape: Mesh shape; ids index its devices in row-major order.
        axis_names: Mesh axis names.

    Returns:
        The axes (in mesh order) where some source and target coordinates
        differ, or None when an id is outside the mesh.
    """
    num_devices = math.prod(mesh_shape)
    if any(device >= num_devices for pair in pairs for device in pair):
        return None
    coordinates = _mesh_coordinates(mesh_shape)
    varying = set()
    for source, target in pairs:
        differs = coordinates[source] != coordinates[target]
        varying.update(np.flatnonzero(differs).tolist())
    return tuple(axis_names[dim] for dim in sorted(varying))
