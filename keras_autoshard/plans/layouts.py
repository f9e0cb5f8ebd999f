"""The entries of a plan: one variable's layout, one activation's layout."""

from __future__ import annotations

import dataclasses
import math

from keras_autoshard.plans.mesh import (
    MeshSpec,
    SpecEntry,
    dtype_itemsize,
    normalize_spec,
)


@dataclasses.dataclass(frozen=True)
class VariableSharding:
    """The layout of one variable.

    Args:
        path: The variable's `path` (e.g. `"dense/kernel"`).
        shape: The variable's global shape.
        dtype: The variable's dtype name.
        spec: Per dimension, a mesh axis name, a tuple of mesh axis names
            (the dim cut over all of them, the first major, as in
            `jax.sharding.PartitionSpec`), or `None` (not cut).
        roles: The logical role of each dimension (`"heads"`, `"mlp"`,
            `"vocab"`, `"embed"`, `"examples"`, ...) or `None` when unknown.
        reason: Why the planner chose this spec (empty for hand-written plans).

    Example:

    ```python
    mesh = MeshSpec((2, 4), ("batch", "model"))
    up = VariableSharding("up/kernel", (64, 256), "float32", (None, "model"),
                          roles=("embed", "mlp"))
    up.bytes_per_device(mesh)  # 64 * 256 * 4 / 4 = 16384
    ```
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[SpecEntry, ...]
    roles: tuple[str | None, ...] = ()
    reason: str = ""

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "spec", normalize_spec(self.spec))
        roles = tuple(self.roles) if self.roles else (None,) * len(self.shape)
        object.__setattr__(self, "roles", roles)
        object.__setattr__(self, "dtype", str(self.dtype))

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole (unsharded) variable."""
        return math.prod(self.shape) * dtype_itemsize(self.dtype)

    def shard_factor(self, mesh: MeshSpec) -> int:
        """Into how many pieces the spec cuts this variable on `mesh`."""
        return math.prod(mesh.axis_size(a) for a in self.spec if a is not None)

    def bytes_per_device(self, mesh: MeshSpec) -> int:
        """Bytes of this variable that each device holds on `mesh`."""
        return self.total_bytes // self.shard_factor(mesh)


@dataclasses.dataclass(frozen=True)
class ActivationLayout:
    """A layout constraint on a layer output.

    Args:
        path: The Keras layer path followed by `/output`
            (e.g. `"transformer_layer_0/output"`), as Keras asks
            `Distribution.get_tensor_layout` for it.
        spec: Per dimension of the output, a mesh axis name, a tuple of
            mesh axis names, or `None` (as in `VariableSharding`).

    Example:

    ```python
    # Keep each block's output split over the batch only (no drift to FSDP
    # layouts of the activations), as in a plan's `activations`.
    pinned = ActivationLayout("transformer_layer_0/output", ("batch", None, None))
    ```
    """

    path: str
    spec: tuple[SpecEntry, ...]

    def __post_init__(self):
        object.__setattr__(self, "spec", normalize_spec(self.spec))
