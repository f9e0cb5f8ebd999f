"""Read-only views of the tensors in HDF5 and safetensors files, by hyperslab.

Each file kind lists its tensors as plain `StoredTensor` records (file, key,
shape, dtype) and reads any rectangular slice of one without reading the
rest: h5py dataset slicing, safetensors `get_slice`. Damaged files are
reported as `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Protocol

import h5py
import ml_dtypes
import numpy as np

from keras_autoshard.errors import CheckpointError

# One `slice` with concrete bounds per dimension.
SliceIndex = tuple[slice, ...]

_SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor in a file.

    Args:
        file: Path of the file holding it.
        key: Its name in the file (an HDF5 dataset path or safetensors key).
        shape: Its global shape.
        dtype: Its dtype name as Keras spells it (`"float32"`, `"bfloat16"`).
    """

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return (
            int(np.prod(self.shape, dtype=np.int64)) * numpy_dtype(self.dtype).itemsize
        )


class TensorFile(Protocol):
    """A file of named tensors that can be read one hyperslab at a time."""

    path: str

    def tensors(self) -> dict[str, StoredTensor]: ...

    def read(self, key: str, index: SliceIndex) -> np.ndarray: ...

    def close(self) -> None: ...


def check_compatible(tensor: StoredTensor, variable) -> None:
    """Raise `CheckpointError` unless `tensor` has the variable's shape and
    dtype (values are never cast or reshaped silently)."""
    shape = tuple(int(s) for s in variable.shape)
    if tensor.shape != shape:
        raise CheckpointError(
            f"Tensor {tensor.key!r} in {tensor.file} has shape {tensor.shape} but "
            f"variable {variable.path!r} has shape {shape}. The file is from a "
            "model with other dimensions; build the model with the file's config."
        )
    if tensor.dtype != variable.dtype:
        raise CheckpointError(
            f"Tensor {tensor.key!r} in {tensor.file} has dtype {tensor.dtype} but "
            f"variable {variable.path!r} has dtype {variable.dtype}. Build the "
            f"model with dtype {tensor.dtype!r} (values are never cast silently)."
        )


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a Keras dtype name (ml_dtypes for bfloat16, fp8)."""
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


class H5TensorFile:
    """The datasets of an HDF5 file (a Keras `.weights.h5`, say).

    Args:
        path: The HDF5 file.

    Example:

    ```python
    with_file = H5TensorFile("model.weights.h5")
    kernel = with_file.read("layers/dense/vars/0", (slice(0, 8), slice(0, 4)))
    with_file.close()
    ```
    """

    def __init__(self, path: str):
        self.path = str(path)
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as error:
            raise CheckpointError(
                f"Cannot open {self.path} as an HDF5 weights file ({error}). The "
                "file is truncated, corrupted or not HDF5: re-save or re-download it."
            ) from error
        self._tensors: dict[str, StoredTensor] | None = None

    def tensors(self) -> dict[str, StoredTensor]:
        if self._tensors is None:
            found: dict[str, StoredTensor] = {}

            def visit(name, node):
                if isinstance(node, h5py.Dataset):
                    found[name] = StoredTensor(
                        self.path, name, tuple(node.shape), _h5_dtype_name(node)
                    )

            try:
                self._file.visititems(visit)
            except (OSError, RuntimeError) as error:
                raise CheckpointError(
                    f"Cannot list the datasets of {self.path} ({error}); the file "
                    "is corrupted. Re-save or re-download it."
                ) from error
            self._tensors = found
        return self._tensors

    def check_within_file(self, key: str) -> None:
        """Raise if a contiguous dataset's bytes run past the end of the file."""
        dataset = self._file[key]
        offset = dataset.id.get_offset()
        if offset is None:  # chunked or empty: checked when read
            return
        end = offset + dataset.id.get_storage_size()
        file_size = os.path.getsize(self.path)
        if end > file_size:
            raise CheckpointError(
                f"{self.path} is truncated: dataset {key!r} ends at byte {end} "
                f"but the file has {file_size} bytes. Re-save or re-download it."
            )

    def read(self, key: str, index: SliceIndex) -> np.ndarray:
        tensor = self.tensors()[key]
        try:
            data = self._file[key][index] if index else self._file[key][()]
        except (OSError, RuntimeError, ValueError) as error:
            raise CheckpointError(
                f"Reading {key!r} {_describe_index(index)} from {self.path} failed "
                f"({error}); the file is corrupted. Re-save or re-download it."
            ) from error
        data = np.asarray(data)
        if tensor.dtype == "bfloat16":  # Keras stores bfloat16 as opaque 2 bytes
            data = data.view(ml_dtypes.bfloat16)
        return data

    def close(self) -> None:
        self._file.close()


class SafetensorsTensorFile:
    """The tensors of a `.safetensors` file, read through `get_slice`.

    Args:
        path: The safetensors file.
    """

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = str(path)
        try:
            self._file = safe_open(self.path, framework="np")
            self._tensors = {key: self._describe(key) for key in self._file.keys()}
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(
                f"Cannot read {self.path} as a safetensors file ({error}). The file "
                "is truncated, corrupted or not safetensors: re-save or re-download it."
            ) from error

    def _describe(self, key: str) -> StoredTensor:
        view = self._file.get_slice(key)
        dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
        if dtype is None:
            raise CheckpointError(
                f"Tensor {key!r} in {self.path} has dtype {view.get_dtype()}, which "
                f"this loader does not read (known: {sorted(_SAFETENSORS_DTYPES)})."
            )
        return StoredTensor(self.path, key, tuple(view.get_shape()), dtype)

    def tensors(self) -> dict[str, StoredTensor]:
        return self._tensors

    def read(self, key: str, index: SliceIndex) -> np.ndarray:
        try:
            if not index:
                return np.asarray(self._file.get_tensor(key))
            return np.asarray(self._file.get_slice(key)[index])
        except Exception as error:
            raise CheckpointError(
                f"Reading {key!r} {_describe_index(index)} from {self.path} failed "
                f"({error}). Re-save or re-download the file."
            ) from error

    def close(self) -> None:
        self._file = None


def _h5_dtype_name(dataset: h5py.Dataset) -> str:
    if dataset.attrs.get("dtype") == "bfloat16":
        return "bfloat16"
    return str(dataset.dtype)


def _describe_index(index: SliceIndex) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in index) + "]"
