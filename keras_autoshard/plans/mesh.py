"""The mesh vocabulary every stage speaks: mesh shapes and axis names, the
partition spec type, and dtype sizes.

Mesh axis names are defined here once. Axes named in `DATA_AXIS_NAMES` split
the batch (and may hold FSDP-style storage cuts); every other axis is free for
tensor parallelism. Logical roles of dimensions (`heads`, `mlp`, `vocab`,
`embed`, `tokens`) are a separate vocabulary (`planner/roles.py`) and never
reuse a mesh axis name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from keras_autoshard.errors import PlanError

# The default two-axis mesh: data parallelism, then tensor parallelism.
DATA_AXIS = "batch"
MODEL_AXIS = "model"
DEFAULT_AXIS_NAMES = (DATA_AXIS, MODEL_AXIS)
# Axis names that split the batch.
DATA_AXIS_NAMES = frozenset({"batch", "data", "dp", "fsdp", "replica"})
# Axis names reserved for tensor parallelism (never split the batch).
MODEL_AXIS_NAMES = frozenset({"model", "tensor", "tp", "mp"})

# What cuts one tensor dimension: a mesh axis name, an ordered tuple of mesh
# axis names (the dim cut over their product, the first name major, as in a
# JAX `PartitionSpec` entry `("batch", "model")`), or None (not cut).
SpecEntry = str | tuple[str, ...] | None
# One `SpecEntry` per tensor dimension.
Spec = Sequence[SpecEntry]
# Joins the axes of a multi-axis entry in text (`"batch+model"`); mesh axis
# names may not contain it.
SPANNING_SEPARATOR = "+"

# Bytes per element for dtype names as Keras spells them.
_DTYPE_BYTES = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def entry_axes(entry: SpecEntry | Sequence[str]) -> tuple[str, ...]:
    """The mesh axes one spec entry cuts its dimension over, major first.

    Args:
        entry: `None`, a mesh axis name, or a sequence of mesh axis names.

    Returns:
        A tuple of axis names (empty for `None`).

    Example:

    ```python
    entry_axes(("batch", "model"))  # ("batch", "model")
    entry_axes("batch+model")  # ("batch", "model"), as tables print it
    entry_axes("model")  # ("model",)
    entry_axes(None)  # ()
    ```
    """
    if entry is None:
        return ()
    if isinstance(entry, str):
        return tuple(entry.split(SPANNING_SEPARATOR))
    return tuple(str(a) for a in entry)


def normalize_entry(entry: SpecEntry | Sequence[str]) -> SpecEntry:
    """One spec entry in its one spelling: `None` for no axis, the name for
    one axis, a tuple for several (a list, as JSON reads it, becomes a tuple).

    Args:
        entry: `None`, a mesh axis name, or a sequence of mesh axis names.

    Returns:
        `None`, a `str`, or a tuple of two or more names.

    Example:

    ```python
    normalize_entry(["batch", "model"])  # ("batch", "model")
    normalize_entry(("model",))  # "model"
    normalize_entry(())  # None
    ```
    """
    axes = entry_axes(entry)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def normalize_spec(spec: Sequence) -> tuple[SpecEntry, ...]:
    """`normalize_entry` of every entry of `spec`, as a tuple."""
    return tuple(normalize_entry(entry) for entry in spec)


def spec_axes(spec: Sequence) -> tuple[str, ...]:
    """Every mesh axis a spec uses, in dimension order (a name once per use)."""
    return tuple(axis for entry in spec for axis in entry_axes(entry))


def entry_text(entry: SpecEntry) -> str:
    """A spec entry as the tables print it: `-`, `model`, `batch+model`."""
    axes = entry_axes(entry)
    return SPANNING_SEPARATOR.join(axes) if axes else "-"


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name such as `"float32"`.

    Args:
        dtype: Dtype name as Keras spells it.

    Returns:
        The size of one element in bytes.
    """
    name = str(dtype)
    if name not in _DTYPE_BYTES:
        raise PlanError(f"Unknown dtype {name!r}; known: {sorted(_DTYPE_BYTES)}.")
    return _DTYPE_BYTES[name]


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Shape and axis names of a device mesh, without the devices.

    Args:
        shape: Number of devices along each mesh axis.
        axis_names: One name per mesh axis.

    Example:

    ```python
    mesh = MeshSpec(shape=(2, 4), axis_names=("batch", "model"))
    mesh.axis_size("model")  # 4
    ```
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "axis_names", tuple(str(a) for a in self.axis_names))
        if len(self.shape) != len(self.axis_names):
            raise PlanError(
                f"Mesh shape {self.shape} has {len(self.shape)} axes but "
                f"{len(self.axis_names)} axis names {self.axis_names} were given."
            )
        joined = [name for name in self.axis_names if SPANNING_SEPARATOR in name]
        if joined:
            raise PlanError(
                f"Mesh axis names may not contain {SPANNING_SEPARATOR!r} (it joins "
                f"the axes of a multi-axis spec entry): {joined}."
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise PlanError(f"Mesh axis names must be distinct: {self.axis_names}.")
        if any(size < 1 for size in self.shape):
            raise PlanError(f"Mesh axis sizes must be >= 1: {self.shape}.")

    @property
    def device_count(self) -> int:
        """Number of devices in the mesh (the product of its sizes)."""
        return math.prod(self.shape)

    def axis_size(self, axis_name: str | Sequence[str]) -> int:
        """Number of devices along `axis_name`; for a tuple of names (a spec
        entry that cuts one dim over several axes), their product."""
        if not isinstance(axis_name, str):
            return math.prod(self.axis_size(a) for a in axis_name)
        if axis_name not in self.axis_names:
            raise PlanError(
                f"Unknown mesh axis {axis_name!r}; the mesh has axes "
                f"{self.axis_names} with sizes {self.shape}."
            )
        return self.shape[self.axis_names.index(axis_name)]

    def describe(self) -> str:
        """The mesh as text, e.g. `"batch=2 x model=4"`."""
        return " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
