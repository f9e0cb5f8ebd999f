"""`save_safetensors`: a model's weights as one `.safetensors` file, on the
JAX and PyTorch backends alike.

Tensors are named by Keras's weights-file keys (`layers/dense/vars/0`,
unique even where variable paths repeat), so `load_weights_sharded` reads
the file back into the same model on either backend, slice by slice. The
writing (one tensor at a time, from the first process) is
`io/safetensors_writer.py`.
"""

from __future__ import annotations

import os

from keras_autoshard.checkpoint.sharded_load import weights_owner
from keras_autoshard.io.keras_weights_layout import weight_file_entries
from keras_autoshard.io.safetensors_writer import write_safetensors


def save_safetensors(
    model, path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """Write `model`'s weights (not its optimizer state) to a safetensors file.

    Every process (torchrun rank, or JAX process) must call it with the same
    path.

    Args:
        model: A built Keras model, sharded or not, or a `TensorParallel`
            wrapper (the wrapped model's weights are written).
        path: The target, ending in `.safetensors`.
        metadata: String → string pairs stored in the file's header.

    Raises:
        CheckpointError: the path does not end in `.safetensors`, a dtype
            has no safetensors code, or the writer failed (raised on every
            process).

    Example:

    ```python
    save_safetensors(model, "model.safetensors")
    load_weights_sharded(other_model, "model.safetensors")  # either backend
    ```
    """
    write_safetensors(weight_file_entries(weights_owner(model)), path, metadata)
