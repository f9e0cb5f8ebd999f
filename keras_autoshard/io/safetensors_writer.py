"""Write tensors to one `.safetensors` file, one tensor at a time, from
every process of a job (JAX processes or torchrun ranks).

The header is known from shapes and dtypes alone, so it is written first and
each tensor's bytes follow as soon as that tensor is gathered: the writer
holds one whole tensor at a time beyond its shards, never the model. Every
process gathers (a collective); the first process writes, into
`path + ".partial"` renamed over `path` once complete. Which tensors and
under which names is the caller's (`checkpoint/safetensors_save.py`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from keras_autoshard.errors import CheckpointError
from keras_autoshard.io.torch.dtensor_shards import full_numpy, is_dtensor

SAFETENSORS_SUFFIX = ".safetensors"
_DTYPE_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "float16": "F16",
    "bfloat16": "BF16",
    "uint32": "U32",
    "int32": "I32",
    "float32": "F32",
    "uint64": "U64",
    "int64": "I64",
    "float64": "F64",
}


def write_safetensors(
    entries: Mapping[str, Any],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `entries` (file key → Keras variable) to a safetensors file.

    Every process must call it with the same entries in the same order.

    Args:
        entries: Key → variable (its value a JAX array, a torch tensor or a
            DTensor; gathered whole one at a time).
        path: The target, ending in `.safetensors`.
        metadata: String → string pairs stored in the header.

    Raises:
        CheckpointError: the path does not end in `.safetensors`, a dtype
            has no safetensors code, or the writer failed (on every process).
    """
    path = os.fspath(path)
    if not path.endswith(SAFETENSORS_SUFFIX):
        raise CheckpointError(
            f"The file must end in {SAFETENSORS_SUFFIX!r}; got {path!r}."
        )
    header = _header(entries, metadata or {})
    writer = _process_index() == 0
    partial = f"{path}.partial"
    problem = ""
    handle = None
    if writer:
        try:
            handle = open(partial, "wb")
            handle.write(struct.pack("<Q", len(header)))
            handle.write(header)
        except OSError as error:
            problem = f"cannot write {partial} ({error})"
    for key, variable in entries.items():
        array = _gathered(variable.value)  # every process, in one order
        if handle is not None and not problem:
            try:
                handle.write(np.ascontiguousarray(array).tobytes())
            except OSError as error:
                problem = f"writing {key!r} ({variable.path}) failed ({error})"
        del array
    if handle is not None:
        handle.close()
    if _failed_anywhere(bool(problem)):
        if writer and os.path.exists(partial):
            os.remove(partial)
        raise CheckpointError(
            f"Saving {path} failed on the writing process: "
            f"{problem or 'see process 0'}. Nothing was written at the path."
        )
    if writer:
        os.replace(partial, path)
    _barrier()


def _header(entries: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """The JSON header, padded with spaces to a multiple of 8 bytes."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for key, variable in entries.items():
        dtype = str(variable.dtype)
        code = _DTYPE_CODES.get(dtype)
        if code is None:
            raise CheckpointError(
                f"Variable {variable.path!r} has dtype {dtype}, which safetensors "
                f"cannot store (known: {sorted(_DTYPE_CODES)}). Save a "
                ".weights.h5 file instead."
            )
        shape = [int(s) for s in variable.shape]
        size = (
            int(np.prod(shape, dtype=np.int64)) * np.dtype(_numpy_dtype(dtype)).itemsize
        )
        header[key] = {
            "dtype": code,
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _gathered(value) -> np.ndarray:
    """The whole tensor on the host: a torch tensor or DTensor through
    `full_numpy`, a JAX array gathered across processes when it spans
    several."""
    if is_dtensor(value) or type(value).__module__.startswith("torch"):
        return full_numpy(value)
    import jax

    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def _process_index() -> int:
    import keras

    if keras.backend.backend() == "torch":
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if keras.backend.backend() == "jax":
        import jax

        return jax.process_index()
    return 0


def _failed_anywhere(failed: bool) -> bool:
    """Whether any process failed (a collective where there are several)."""
    import keras

    if keras.backend.backend() == "torch":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from keras_autoshard.runtime.torch_processes import failed_on_any_rank

            return failed_on_any_rank(failed)
        return failed
    if keras.backend.backend() == "jax":
        import jax

        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.array([int(failed)]))
            return bool(np.max(flags))
    return failed


def _barrier() -> None:
    import keras

    if keras.backend.backend() == "torch":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    elif keras.backend.backend() == "jax":
        import jax

        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("keras_autoshard.save_safetensors")
