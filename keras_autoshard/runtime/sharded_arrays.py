"""Build sharded JAX arrays slice by slice, and describe arrays' shardings.

The checkpoint loaders read one slice of a stored tensor per device and hand
it to `jax.make_array_from_callback`, so the host never holds more than one
slice. This module is the only place where the checkpoint code touches JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from keras_autoshard.compat import keras_variables

# One index per dimension, as `jax.make_array_from_callback` passes it.
SliceIndex = tuple[slice, ...]


def variable_sharding(variable) -> jax.sharding.Sharding:
    """The sharding a Keras variable's value currently has.

    Args:
        variable: A Keras variable on the JAX backend.

    Returns:
        Its `jax.sharding.Sharding` (a `NamedSharding` under a distribution,
        a `SingleDeviceSharding` otherwise). For a variable created without a
        value (deferred), the sharding the active distribution gives it.
    """
    if not keras_variables.has_value(variable):
        layout = keras_variables.deferred_layout(variable)
        if layout is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return layout.backend_layout
    return variable.value.sharding


def assemble_from_slices(
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: jax.sharding.Sharding,
    read_slice: Callable[[SliceIndex], np.ndarray],
) -> jax.Array:
    """A global array whose every device slice comes from `read_slice`.

    Each distinct slice is read once, copied to every device that holds it,
    and dropped once those copies are done, so the host holds one slice at
    a time. (`jax.make_array_from_callback` would do the same reads, but lets
    the host copies pile up until its asynchronous transfers run.)

    Args:
        shape: Global shape.
        dtype: Element type of the slices `read_slice` returns.
        sharding: Target sharding (the variable's `NamedSharding`).
        read_slice: Reads the hyperslab at an index (a tuple of `slice`, one
            per dimension, with concrete bounds) and returns it as NumPy.

    Returns:
        The assembled `jax.Array`.

    Example:

    ```python
    array = assemble_from_slices((8, 4), np.float32, sharding,
                                 lambda index: dataset[index])
    ```
    """
    shape = tuple(shape)
    devices_by_slice: dict[tuple, list] = {}
    index_by_slice: dict[tuple, SliceIndex] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        concrete = concrete_index(index, shape)
        key = tuple((part.start, part.stop) for part in concrete)
        devices_by_slice.setdefault(key, []).append(device)
        index_by_slice[key] = concrete
    per_device = {}
    for key, devices in devices_by_slice.items():
        host_slice = np.asarray(read_slice(index_by_slice[key]), dtype=dtype)
        copies = [jax.device_put(host_slice, device) for device in devices]
        jax.block_until_ready(copies)
        per_device.update(zip(devices, copies))
        del host_slice
    ordered = [per_device[device] for device in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, ordered)


def release_value(variable) -> None:
    """Free the device buffers of a variable's current value now.

    Loading then holds the old and the new value of a variable at no moment
    together; the variable must be assigned before it is used again. A
    variable without a value (deferred) has nothing to free.
    """
    if keras_variables.has_value(variable):
        variable.value.delete()


def concrete_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> SliceIndex:
    """`index` with every `slice(None)` replaced by explicit bounds."""
    padded = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*part.indices(size)[:2]) for part, size in zip(padded, shape))


def shard_nbytes_by_device(array: jax.Array) -> dict[str, int]:
    """Bytes of `array` each addressable device holds, by device name."""
    return {str(shard.device): shard.data.nbytes for shard in array.addressable_shards}


def slice_nbytes(array: jax.Array) -> int:
    """Bytes of the largest single-device slice of `array`."""
    return max(shard.data.nbytes for shard in array.addressable_shards)


def abstract_like(state_tree: Mapping[str, Any]) -> dict[str, Any]:
    """Shape, dtype and sharding of every array in a nested dict, without data.

    Args:
        state_tree: Nested dicts of `jax.Array` (as `model.get_state_tree()`).

    Returns:
        The same nesting with `jax.ShapeDtypeStruct` leaves carrying each
        array's sharding, to tell Orbax where each restored slice goes.
    """

    def convert(node):
        if isinstance(node, Mapping):
            return {key: convert(value) for key, value in node.items()}
        array = jax.numpy.asarray(node) if not hasattr(node, "sharding") else node
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)

    return convert(state_tree)


def local_shard_bytes(array) -> int:
    """Bytes of `array` this process owns and would write (one copy per slice).

    Args:
        array: A `jax.Array` (its addressable shards of replica 0 count) or
            any array-like (all its bytes count).

    Returns:
        Byte count.
    """
    if isinstance(array, jax.Array):
        return sum(
            shard.data.nbytes
            for shard in array.addressable_shards
            if shard.replica_id == 0
        )
    return int(np.asarray(array).nbytes)
