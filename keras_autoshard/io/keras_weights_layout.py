"""Where Keras's `.weights.h5` layout puts each variable of a model.

`model.save_weights` walks the model with Keras's saving traversal: layers of
Functional and Sequential models first (named by class in snake case with a
counter: `layers/dense`, `layers/dense_1`), then every attribute in sorted
order, each layer storing its own variables as `<path>/vars/<index>`. Rather
than re-deriving those names, this module runs that same traversal with a
store that records which variable lands at which key, so the mapping follows
Keras exactly (nested layers, containers, renamed layers alike).

The optimizer stores gathered NumPy copies instead of its variables; it is
skipped in the traversal (gathering would put whole arrays on the host) and
mapped directly: `optimizer/vars/<i>` is `model.optimizer.variables[i]`.
"""

from __future__ import annotations

from keras_autoshard.compat import keras_saving
from keras_autoshard.errors import CheckpointError

OPTIMIZER_GROUP = "optimizer"


def keras_h5_keys(model) -> dict[str, object]:
    """The `.weights.h5` dataset key of every variable `save_weights` writes.

    Args:
        model: A built Keras model (compiled or not).

    Returns:
        Dataset key (e.g. `"layers/dense/vars/0"`) → Keras variable, in the
        order Keras writes them.

    Example:

    ```python
    keys = keras_h5_keys(model)
    keys["layers/dense/vars/0"].path  # "dense/kernel"
    ```
    """
    optimizer = getattr(model, "optimizer", None)
    # Skipping the optimizer keeps Keras from gathering its state.
    skipped = [optimizer] if optimizer is not None else []
    keys = {}
    for group_path, dataset_key, value in keras_saving.saved_weight_entries(
        model, skipped
    ):
        if not hasattr(value, "path") or not hasattr(value, "assign"):
            raise CheckpointError(
                f"The layer at {group_path!r} saves a derived value (a "
                f"{type(value).__name__}, not a variable) as {dataset_key!r}; "
                "it cannot be loaded slice by slice. Load this model with "
                "keras' model.load_weights instead."
            )
        keys[dataset_key] = value
    if optimizer is not None:
        for index, variable in enumerate(optimizer.variables):
            keys[f"{OPTIMIZER_GROUP}/vars/{index}"] = variable
    return keys


def weight_file_entries(model) -> dict[str, object]:
    """`keras_h5_keys` without the optimizer's variables: the model's own
    weights, keyed as Keras's weights file keys them (unique even where two
    variables share a path).

    Args:
        model: A built Keras model.

    Returns:
        Dataset key → Keras variable.
    """
    return {
        key: variable
        for key, variable in keras_h5_keys(model).items()
        if not key.startswith("optimizer/")
    }
