"""Build Keras `DeviceMesh` objects for a plan's mesh."""

from __future__ import annotations

import math
from collections.abc import Sequence

import keras

from keras_autoshard.plans.sharding_plan import MeshSpec, PlanError


def make_device_mesh(
    mesh: MeshSpec, devices: Sequence[str] | None = None
) -> keras.distribution.DeviceMesh:
    """A `keras.distribution.DeviceMesh` with the plan mesh's shape and names.

    Args:
        mesh: Shape and axis names.
        devices: Device names as `keras.distribution.list_devices()` gives them;
            defaults to all devices, which must number exactly `mesh.device_count`.

    Returns:
        The `DeviceMesh`.

    Example:

    ```python
    device_mesh = make_device_mesh(MeshSpec((2, 4), ("batch", "model")))
    ```
    """
    available = list(devices) if devices is not None else _all_devices()
    if len(available) != mesh.device_count:
        raise PlanError(
            f"Mesh {mesh.describe()} needs {mesh.device_count} devices but "
            f"{len(available)} were given ({available[:4]}"
            f"{'...' if len(available) > 4 else ''}). Choose a mesh whose sizes "
            f"multiply to {len(available)}, or pass that many devices (with no "
            "accelerator, simulate host devices: keras_autoshard.simulate_devices"
            f"({mesh.device_count}) before importing JAX)."
        )
    return keras.distribution.DeviceMesh(
        shape=mesh.shape, axis_names=list(mesh.axis_names), devices=available
    )


def default_mesh_shape(device_count: int, model_axis_size: int | None = None) -> tuple:
    """A (data, model) mesh shape for `device_count` devices.

    Uses `model_axis_size` when given (it must divide the device count);
    otherwise the largest power of two up to 8 dividing the count for the
    model axis, the rest for data.
    """
    if model_axis_size is None:
        model_axis_size = math.gcd(device_count, 8)
    if device_count % model_axis_size:
        raise PlanError(
            f"Model axis size {model_axis_size} does not divide the device count "
            f"{device_count}."
        )
    return (device_count // model_axis_size, model_axis_size)


def _all_devices() -> list[str]:
    return list(keras.distribution.list_devices())
