"""Read and write the local shard of a DTensor-valued Keras variable.

On the PyTorch backend a sharded variable's value is a `DTensor`: each rank
holds one block of it. Loading fills that block from the matching slice of a
stored tensor (the loaders read only that slice); saving gathers one whole
tensor at a time. This module is the only place where checkpoint code touches
DTensor.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# One index per dimension, as the checkpoint readers take it.
SliceIndex = tuple[slice, ...]


def is_dtensor(value) -> bool:
    """Whether `value` is a `torch.distributed.tensor.DTensor`."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch not installed
        return False
    return isinstance(value, DTensor)


def local_slice_index(dtensor) -> SliceIndex:
    """The block of the global tensor this rank holds, as slices.

    Placements are applied mesh dim by mesh dim, each `Shard(d)` cutting the
    current extent of dim `d` into `torch.chunk` pieces (ceil-sized, the last
    ones shorter or empty), as DTensor lays them out.

    Args:
        dtensor: A `DTensor`.

    Returns:
        One `slice` per dimension of the global shape.
    """
    from torch.distributed.tensor import Shard

    shape = tuple(int(s) for s in dtensor.shape)
    starts = [0] * len(shape)
    lengths = list(shape)
    coordinate = dtensor.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(dtensor.placements):
        if not isinstance(placement, Shard):
            continue
        dim = placement.dim % len(shape)
        pieces = dtensor.device_mesh.size(mesh_dim)
        chunk = -(-lengths[dim] // pieces)
        begin = min(coordinate[mesh_dim] * chunk, lengths[dim])
        starts[dim] += begin
        lengths[dim] = min(chunk, lengths[dim] - begin)
    return tuple(slice(s, s + n) for s, n in zip(starts, lengths))


def fill_local_shard(variable, read: Callable[[SliceIndex], np.ndarray]) -> int:
    """Assign a variable from a stored tensor, reading only this rank's block.

    Args:
        variable: A Keras variable on the torch backend (DTensor or plain).
        read: `read(index)` returns that slice of the stored tensor.

    Returns:
        Bytes read.
    """
    import torch

    value = variable.value
    if not is_dtensor(value):
        data = read(tuple(slice(0, int(s)) for s in value.shape))
        variable.assign(data)
        return data.nbytes
    index = local_slice_index(value)
    data = read(index)
    local = value.to_local()
    with torch.no_grad():
        local.copy_(_to_torch(data, local.dtype))
    return data.nbytes


def full_numpy(value) -> np.ndarray:
    """The whole tensor as a NumPy copy: a DTensor is gathered (a collective
    every rank of its mesh must enter), a plain tensor copied to the host
    (never a view of the live storage, which training updates in place).
    bfloat16 comes back as `ml_dtypes.bfloat16`."""
    import torch

    if is_dtensor(value):
        value = value.full_tensor()
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        import ml_dtypes

        return value.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return value.numpy().copy()


def _to_torch(data: np.ndarray, dtype):
    import torch

    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(
            torch.bfloat16
        )
    return torch.from_numpy(np.ascontiguousarray(data)).to(dtype)
