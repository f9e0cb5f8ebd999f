"""Keras `TensorLayout`s whose dimensions may be cut over several mesh axes.

A plan may cut one dimension over several mesh axes at once (the batch over
the whole 2-D mesh: `("batch", "model")`, the first axis major), as a JAX
`PartitionSpec` entry does. Keras's `TensorLayout` hands its `axes` to JAX as
they are (`PartitionSpec(*axes)`), but checks that each entry is one mesh
axis name. `tensor_layout` returns a plain `TensorLayout` for a spec of
names and `None`s, and otherwise an instance of a `TensorLayout` subclass
whose check accepts a tuple of the mesh's names. Keras is imported inside the
functions, never at import time.

Private: `TensorLayout._validate_axes` (overridden by the subclass), checked
on keras 3.15.1.
If it changes: Keras rejects a multi-axis entry ("Invalid axis names") when
the layout is made; `missing_privates()` reports it (`keras_checks`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any


def tensor_layout(spec: Sequence, device_mesh=None) -> Any:
    """A Keras layout for `spec` on `device_mesh`.

    Args:
        spec: Per dimension, a mesh axis name, a tuple of mesh axis names
            (the dimension cut over all of them, the first major), or `None`.
        device_mesh: A `keras.distribution.DeviceMesh`, or `None` (a
            `LayoutMap` fills it in).

    Returns:
        A `keras.distribution.TensorLayout` (a subclass of it when an entry
        names several axes).

    Example:

    ```python
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices)
    layout = tensor_layout((("batch", "model"), None), mesh)
    layout.backend_layout.spec  # PartitionSpec(('batch', 'model'), None)
    ```
    """
    from keras.distribution import TensorLayout

    axes = [e if e is None or isinstance(e, str) else tuple(e) for e in spec]
    if not any(isinstance(entry, tuple) for entry in axes):
        return TensorLayout(axes, device_mesh)
    return _multi_axis_layout_class()(axes, device_mesh)


@functools.cache
def _multi_axis_layout_class() -> type:
    from keras.distribution import TensorLayout

    class MultiAxisTensorLayout(TensorLayout):
        """A `TensorLayout` whose entries may be tuples of mesh axis names."""

        def _validate_axes(self):
            if self.device_mesh is None:
                return
            names = set()
            for entry in self.axes:
                if entry is not None:
                    names.update((entry,) if isinstance(entry, str) else entry)
            unknown = names - set(self.device_mesh.axis_names)
            if unknown:
                raise ValueError(
                    f"Invalid axis names for Layout. Valid axis names: "
                    f"{self.device_mesh.axis_names}, Got {sorted(unknown)}"
                )

    return MultiAxisTensorLayout
