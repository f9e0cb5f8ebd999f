"""Keras's saving internals, each use behind one named function: the
traversal `model.save_weights` writes in, the state tree's nesting, and a
`.keras` archive's model config JSON.

Checked on keras 3.15.1 and keras-nightly 3.16.0.dev2026102704 unless a
function says otherwise; `keras_private.missing_privates()` checks these too.
Keras is imported inside the functions, never at import time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any


def nested_state_dict(model, variables) -> dict:
    """`model.get_state_tree()`'s nesting of `variables` (by path), holding
    backend tensors.

    Private: `Model._create_nested_dict(variables, "backend_tensor")`.
    If it changes: `save_checkpoint` of a model without an optimizer fails.
    """
    return model._create_nested_dict(variables, "backend_tensor")


def saved_weight_entries(model, skipped: Iterable = ()) -> list[tuple[str, str, Any]]:
    """What `model.save_weights` writes, in its order, without writing:
    `(group path, dataset key, value)` per saved value, the key as in a
    `.weights.h5` file (`layers/dense/vars/0`). Objects in `skipped` (the
    optimizer) are not traversed.

    Private: `keras.src.saving.saving_lib._save_state` and the protocol of
    its `H5IOStore` (`make(path, metadata)`, item assignment).
    If they change: weights files cannot be loaded or saved slice by slice
    (`load_weights_sharded`, `TensorParallel.load_weights` on PyTorch).
    """
    from keras.src.saving import saving_lib

    store = _recording_store_class()()
    saving_lib._save_state(
        model,
        weights_store=store,
        assets_store=None,
        inner_path="",
        visited_saveables={id(item) for item in skipped},
    )
    return store.entries


@functools.cache
def _recording_store_class() -> type:
    from keras.src.saving import saving_lib

    class RecordingStore(saving_lib.H5IOStore):
        """A write-mode weights store that records keys instead of writing."""

        def __init__(self):  # no file: nothing is written
            self.entries: list[tuple[str, str, Any]] = []
            self._group_path = ""

        def __bool__(self) -> bool:
            return True

        def make(self, path, metadata=None):
            self._group_path = path
            return self

        def __setitem__(self, key, value):
            dataset_key = f"{self._group_path}/vars/{key}".lstrip("/")
            self.entries.append((self._group_path, dataset_key, value))

    return RecordingStore


def model_from_config_json(config_json: str, compile: bool) -> Any:
    """The model a `.keras` archive's config JSON describes (safe mode),
    compiled when `compile` and the config holds a training configuration.

    Private: `keras.src.saving.saving_lib._model_from_config`.
    If it changes: `load_model_sharded` fails.
    """
    from keras.src.saving import saving_lib

    return saving_lib._model_from_config(
        config_json, custom_objects=None, compile=compile, safe_mode=True
    )


def model_config_json(model) -> str:
    """The config JSON `model.save` writes into a `.keras` archive.

    Private: `keras.src.saving.saving_lib._serialize_model_as_json`.
    If it changes: `save_checkpoint(..., include_model_config=True)` fails.
    """
    from keras.src.saving import saving_lib

    config_json, _ = saving_lib._serialize_model_as_json(model)
    return config_json
