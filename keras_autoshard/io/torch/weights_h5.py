"""Keras `.weights.h5` files written from and read into a model whose
variables are DTensor shards across torch ranks.

Saving: every rank walks the variables in Keras's saving order and gathers
one whole tensor at a time (a collective all ranks enter); rank 0 alone writes
it, into a temporary file renamed over the target once complete, so the
other ranks never touch the file and a failed save leaves no half-written
file at the path. The layout is Keras's own (`io/keras_weights_layout.py`), so
plain Keras loads the file on one process, with any backend.

Loading: each rank reads only the block of every dataset that its shard
holds (an HDF5 hyperslab) and copies it into its local shard.
"""

from __future__ import annotations

import os

import h5py
import numpy as np

from keras_autoshard.errors import CheckpointError
from keras_autoshard.io.keras_weights_layout import keras_h5_keys
from keras_autoshard.io.tensor_files import (
    H5TensorFile,
    SafetensorsTensorFile,
    check_compatible,
)
from keras_autoshard.io.torch.dtensor_shards import fill_local_shard, full_numpy
from keras_autoshard.runtime.torch_processes import failed_on_any_rank

WEIGHTS_SUFFIX = ".weights.h5"


def save_weights_gathered(model, path: str | os.PathLike) -> None:
    """Write `model`'s Keras weights file from rank 0, one tensor at a time.

    Every rank of the job must call it with the same `path`.

    Args:
        model: A built Keras model (torch backend), variables DTensor shards
            or plain tensors.
        path: The target, ending in `.weights.h5`.

    Raises:
        CheckpointError: the path is not a `.weights.h5` file, or rank 0 could
            not write it (raised on every rank).
    """
    import torch.distributed as dist

    path = os.fspath(path)
    if not path.endswith(WEIGHTS_SUFFIX):
        raise CheckpointError(
            f"The weights file must end in {WEIGHTS_SUFFIX!r} (Keras's format); "
            f"got {path!r}."
        )
    writer = dist.get_rank() == 0
    partial = f"{path}.partial"
    problem = ""
    handle = None
    if writer:
        try:
            handle = h5py.File(partial, "w")
        except OSError as error:
            problem = f"cannot create {partial} ({error})"
    for key, variable in keras_h5_keys(model).items():
        array = full_numpy(variable.value)  # every rank gathers, in one order
        if handle is not None and not problem:
            try:
                _write_dataset(handle, key, array)
            except (OSError, ValueError, TypeError) as error:
                problem = f"writing {key!r} ({variable.path}) failed ({error})"
        del array
    if handle is not None:
        handle.close()
    if failed_on_any_rank(bool(problem)):
        if writer and os.path.exists(partial):
            os.remove(partial)
        raise CheckpointError(
            f"Saving {path} failed on rank 0: {problem or 'see rank 0'}. Nothing "
            "was written at the path; free space or choose another path."
        )
    if writer:
        os.replace(partial, path)
    dist.barrier()


def load_weights_local(model, path: str | os.PathLike) -> int:
    """Fill `model`'s variables from a Keras `.weights.h5` file (or a
    `.safetensors` file keyed as one, as `save_safetensors` writes), each
    rank reading only the block its shards hold. Other formats (`.keras`,
    sharded indexes, other key names): `keras_autoshard.load_weights_sharded`.

    Args:
        model: A built Keras model (torch backend), as `save_weights` of it
            (or of the same model on any backend) wrote the file.
        path: The `.weights.h5` file.

    Returns:
        Bytes this rank read.

    Raises:
        CheckpointError: a missing, extra, mis-shaped or mis-typed tensor, or
            a damaged file, named with the variable; found before any
            variable is assigned.
    """
    path = os.fspath(path)
    weights = (
        SafetensorsTensorFile(path)
        if path.endswith(".safetensors")
        else H5TensorFile(path)
    )
    try:
        stored = weights.tensors()
        expected = keras_h5_keys(model)
        missing = [f"{v.path} ({k})" for k, v in expected.items() if k not in stored]
        extra = [k for k in stored if k not in expected]
        if missing or extra:
            raise CheckpointError(
                f"{path} does not match model {model.name!r}: {len(missing)} "
                f"variables not in the file {missing[:8]}, {len(extra)} tensors "
                f"with no variable {extra[:8]}. The file is from another model "
                "or a differently built one."
            )
        for key, variable in expected.items():
            check_compatible(stored[key], variable)
            if isinstance(weights, H5TensorFile):
                weights.check_within_file(key)
        bytes_read = 0
        for key, variable in expected.items():
            bytes_read += fill_local_shard(
                variable, lambda index, key=key: weights.read(key, index)
            )
        return bytes_read
    finally:
        weights.close()


def _write_dataset(handle: h5py.File, key: str, array: np.ndarray) -> None:
    """Write one dataset as Keras's `H5IOStore` does (bfloat16 tagged)."""
    group_path, _, name = key.rpartition("/")
    group = handle.require_group(group_path) if group_path else handle
    if str(array.dtype) == "bfloat16":
        dataset = group.create_dataset(name, data=array)
        dataset.attrs["dtype"] = "bfloat16"
    else:
        group[name] = array
