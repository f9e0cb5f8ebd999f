"""Devices, mesh and backend for `TensorParallel`: plain checks, clear errors.

`TensorParallel(model, world_size, device_ids, distributed_backend)` takes the
arguments of the seed project's `TensorParallelKeras`; this module turns them
into a (data, model) `MeshSpec` over named devices, or says what is wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras

from keras_autoshard.errors import TensorParallelError  # noqa: F401
from keras_autoshard.plans.mesh import DATA_AXIS, MODEL_AXIS
from keras_autoshard.plans.sharding_plan import MeshSpec

BACKENDS = ("auto", "jax", "torch", "tensorflow")


@dataclasses.dataclass(frozen=True)
class TensorParallelSetup:
    """Where a `TensorParallel` model runs.

    Args:
        backend: The distributed backend in use (`"jax"`).
        devices: Device names (`"cpu:3"`), in mesh order.
        mesh: `(len(devices) // world_size, world_size)` over
            `("batch", "model")`.
    """

    backend: str
    devices: tuple[str, ...]
    mesh: MeshSpec

    @property
    def world_size(self) -> int:
        return self.mesh.axis_size(MODEL_AXIS)

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.axis_size(DATA_AXIS)


def resolve_backend(distributed_backend: str) -> str:
    """The distributed backend to use for `distributed_backend`.

    Args:
        distributed_backend: `"auto"` (the Keras backend), `"jax"`, `"torch"`
            or `"tensorflow"` (`"pytorch"` is read as `"torch"`).

    Returns:
        `"jax"`, `"torch"` or `"tensorflow"` (data parallelism only).

    Raises:
        TensorParallelError: for an unknown name, or a name that does not match
            the Keras backend.
    """
    name = str(distributed_backend).lower()
    if name == "pytorch":  # the seed project's spelling
        name = "torch"
    if name not in BACKENDS:
        raise TensorParallelError(
            f"distributed_backend={distributed_backend!r} is not one of "
            f"{BACKENDS}. Use 'auto' to follow the Keras backend."
        )
    keras_backend = keras.backend.backend()
    if name == "auto":
        name = keras_backend
    if name == "torch":
        if keras_backend != "torch":
            raise TensorParallelError(
                "distributed_backend='torch' needs Keras on PyTorch, but Keras is "
                f"running on {keras_backend!r}. Set KERAS_BACKEND=torch before "
                "importing Keras and launch with torchrun; nothing falls back to "
                "another backend."
            )
        return name
    if name == "tensorflow":
        if keras_backend != "tensorflow":
            raise TensorParallelError(
                "distributed_backend='tensorflow' needs Keras on TensorFlow, but "
                f"Keras is running on {keras_backend!r}. Set "
                "KERAS_BACKEND=tensorflow before importing Keras."
            )
        return name
    if name != "jax":
        raise TensorParallelError(
            f"TensorParallel supports the JAX backend; Keras is running on "
            f"{keras_backend!r}. Set KERAS_BACKEND=jax before importing Keras."
        )
    if keras_backend != "jax":
        raise TensorParallelError(
            f"distributed_backend='jax' needs Keras on JAX, but Keras is running "
            f"on {keras_backend!r}. Set KERAS_BACKEND=jax before importing Keras, "
            "or use distributed_backend='auto'."
        )
    return name


def select_devices(
    device_ids: Sequence[str | int] | None,
    available: Sequence[str] | None = None,
) -> tuple[str, ...]:
    """The devices to run on, as `keras.distribution.list_devices()` names them.

    Args:
        device_ids: `None` for every available device (accelerators when there
            are any, else the host devices), or a list of names (`"gpu:0"`,
            case-insensitive) or indices into the available devices.
        available: The devices to choose from; all devices by default.

    Returns:
        The chosen device names, in the order given.

    Raises:
        TensorParallelError: a device that does not exist, or a repeated one.
    """
    available = tuple(available or keras.distribution.list_devices())
    if device_ids is None:
        return available
    chosen = []
    by_name = {name.lower(): name for name in available}
    for device_id in device_ids:
        if isinstance(device_id, int) and not isinstance(device_id, bool):
            if not 0 <= device_id < len(available):
                raise TensorParallelError(
                    f"device_ids names device {device_id}, but only "
                    f"{len(available)} devices exist ({_describe(available)}). "
                    f"Use indices 0..{len(available) - 1} or device names."
                )
            chosen.append(available[device_id])
            continue
        name = by_name.get(str(device_id).lower())
        if name is None:
            raise TensorParallelError(
                f"device_ids names {device_id!r}, which is not an available "
                f"device; available: {_describe(available)}. Pass names from "
                "keras.distribution.list_devices(), or leave device_ids=None to "
                "use them all."
            )
        chosen.append(name)
    if len(set(chosen)) != len(chosen):
        raise TensorParallelError(
            f"device_ids lists a device twice: {list(device_ids)}. Name each once."
        )
    if not chosen:
        raise TensorParallelError("device_ids is empty; name at least one device.")
    return tuple(chosen)


def tensor_parallel_setup(
    world_size: int | None = None,
    device_ids: Sequence[str | int] | None = None,
    distributed_backend: str = "auto",
    available: Sequence[str] | None = None,
) -> TensorParallelSetup:
    """Check `TensorParallel`'s arguments and lay the devices out as a mesh.

    Args:
        world_size: Devices each model copy is cut over (the `"model"` mesh
            axis); the remaining factor of the device count is data parallel.
            `None`: every chosen device.
        device_ids: Devices to use (see `select_devices`).
        distributed_backend: See `resolve_backend`.
        available: The devices to choose from; all devices by default.

    Returns:
        A `TensorParallelSetup`.

    Example:

    ```python
    setup = tensor_parallel_setup(world_size=4)   # on 8 devices
    setup.mesh   # MeshSpec(shape=(2, 4), axis_names=("batch", "model"))
    ```
    """
    backend = resolve_backend(distributed_backend)
    devices = select_devices(device_ids, available)
    count = len(devices)
    if world_size is None:
        world_size = count
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TensorParallelError(
            f"world_size must be a positive int or None, got {world_size!r}."
        )
    if world_size < 1:
        raise TensorParallelError(f"world_size must be >= 1, got {world_size}.")
    if world_size > count:
        raise TensorParallelError(
            f"world_size={world_size} is larger than the {count} device(s) "
            f"available ({_describe(devices)}). Use world_size <= {count}, or "
            "make more devices visible (without accelerators: "
            f"keras_autoshard.simulate_devices({world_size}) before JAX starts)."
        )
    if count % world_size:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise TensorParallelError(
            f"world_size={world_size} does not divide the {count} devices in use, "
            f"so they cannot form a (data, model) mesh. Use one of {divisors}, or "
            f"pass device_ids with a multiple of {world_size} devices."
        )
    mesh = MeshSpec((count // world_size, world_size), (DATA_AXIS, MODEL_AXIS))
    return TensorParallelSetup(backend=backend, devices=devices, mesh=mesh)


def _describe(devices: Sequence[str]) -> str:
    shown = ", ".join(devices[:8])
    return shown + (f", ... ({len(devices)} in all)" if len(devices) > 8 else "")
