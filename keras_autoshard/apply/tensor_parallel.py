"""`TensorParallel`: a Keras model that runs another one cut over devices.

`TensorParallel(...)` returns the subclass for the distributed backend in use
(`apply/jax`, `apply/torch`, `apply/tensorflow`), so `isinstance(tp,
TensorParallel)` holds on every backend. The backend classes are named here
by module path and imported when one is asked for: a JAX job never imports
torch, and the backend modules import this one, not the reverse.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import keras

from keras_autoshard.apply.tensor_parallel_setup import resolve_backend

ModelSource = keras.Model | Callable[[], keras.Model] | Mapping[str, Any]

# distributed backend → (module, class) of its TensorParallel.
BACKEND_CLASSES = {
    "jax": ("keras_autoshard.apply.jax.tensor_parallel", "JaxTensorParallel"),
    "torch": ("keras_autoshard.apply.torch.tensor_parallel", "TorchTensorParallel"),
    "tensorflow": (
        "keras_autoshard.apply.tensorflow.tensor_parallel",
        "TensorFlowTensorParallel",
    ),
}


@keras.saving.register_keras_serializable(package="keras_autoshard")
class TensorParallel(keras.Model):
    """Run a Keras model cut over several devices (tensor parallelism).

    A drop-in `keras.Model`: `compile`, `fit`, `evaluate`, `predict`, the
    `*_on_batch` methods, `summary`, `save_weights`/`load_weights` and `save`
    work as on the wrapped model. The sharding is planned automatically from
    the model's computation graph on the first batch (or on
    `prepare(sample_input)`): weights of matching matrix multiplications are
    cut column-wise then row-wise (Megatron), each optimizer slot is cut like
    its parameter, and XLA inserts the all-reduces over the `"model"` axis.

    Args:
        model: A `keras.Model` (built or not; a built one is moved onto the
            devices shard by shard when planned), a function with no
            arguments that builds one, or a serialized model config (a dict
            from `keras.saving.serialize_keras_object`). Functions and configs
            are built under the distribution, so every variable is created
            sharded and the full model is never held by one device.
        world_size: Devices each model copy is cut over. Defaults to every
            device in use; a smaller value that divides the device count
            leaves the remaining factor to data parallelism (mesh
            `(devices // world_size, world_size)` over `("batch", "model")`).
        device_ids: Devices to use, as names (`"gpu:0"`, `"cpu:3"`) or
            indices. Defaults to every local accelerator, or the (simulated)
            host devices when there is none.
        distributed_backend: `"auto"` (the Keras backend), `"jax"`,
            `"torch"` (under torchrun with KERAS_BACKEND=torch:
            returns a `TorchTensorParallel`) or `"tensorflow"` (data
            parallelism only, `world_size=1`: returns a
            `TensorFlowTensorParallel`).
        sample_input: One global batch of inputs to plan with now instead of
            on the first batch.
        memory_budget: Per-device bytes (a number, or a string such as
            `"16GiB"`) that the whole peak of a training step must fit
            (parameters, gradients, optimizer state, kept activations, data,
            transient buffers): the planner rematerializes layers where the
            sharding alone does not fit, and the plan's notes say when it
            needs gradient accumulation; `None` for no limit.
        rules: Variable path regex → partition spec, pinned in the plan.
        **kwargs: Passed to `keras.Model` (`name`, ...).

    Example:

    ```python
    model = keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    tp_model = keras_autoshard.TensorParallel(model)   # all devices
    tp_model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    tp_model.fit(x_train, y_train, epochs=5)
    print(tp_model.plan.explain())
    ```
    """

    def __new__(cls, *args, **kwargs):
        if cls is TensorParallel:
            backend = kwargs.get(
                "distributed_backend", args[3] if len(args) > 3 else "auto"
            )
            module_name, class_name = BACKEND_CLASSES[resolve_backend(backend)]
            cls = getattr(importlib.import_module(module_name), class_name)
        return super().__new__(cls, *args, **kwargs)

    def summary(self, *args, **kwargs):
        """The wrapped model's summary (its layers, as unwrapped)."""
        return self.wrapped_model.summary(*args, **kwargs)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The backend in use decides the class, not the one that saved.
        return TensorParallel(**config)
