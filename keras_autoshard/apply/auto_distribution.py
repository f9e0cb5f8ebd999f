"""`AutoShardDistribution`: a Keras distribution that plans itself.

`AutoShardDistribution(...)` returns the subclass for the Keras backend in
use (`apply/jax`: planned sharding through XLA; `apply/tensorflow`: data
parallelism through `tf.distribute`), so `isinstance(dist,
AutoShardDistribution)` holds on every backend. The backend classes are named
here by module path and imported when one is asked for; they import this
module, not the reverse.
"""

from __future__ import annotations

import importlib

import keras

from keras_autoshard.compat import keras_private

# Keras backend → (module, class) of its AutoShardDistribution.
BACKEND_CLASSES = {
    "jax": ("keras_autoshard.apply.jax.auto_distribution", "JaxAutoShardDistribution"),
    "tensorflow": (
        "keras_autoshard.apply.tensorflow.data_parallel",
        "TensorFlowAutoShardDistribution",
    ),
}


class AutoShardDistribution(keras_private.distribution_base()):
    """Shard a Keras model automatically: plan from its graph, then apply.

    Args:
        device_mesh: A `keras.distribution.DeviceMesh` (or `MeshSpec`). When
            `None`, the planner picks a (data, model) mesh shape over all
            devices by cost.
        memory_budget: Per-device bytes (a number, or a string such as
            `"16GiB"`) for the whole peak of a training step (`plan()`'s
            `memory_budget`); `None`: the accelerators' memory, no limit
            on simulated CPU devices.
        rules: Regular expression on variable path → spec, pinned; the
            planner fills in the rest.
        sample_input: A batch (or `jax.ShapeDtypeStruct`s) to plan with;
            otherwise the first batch the model sees is used.
        auto_shard_dataset: As in `keras.distribution.Distribution`.
        sequence_parallel: Plan with sequence parallelism (`plan()`'s
            `sequence_parallel`); JAX only.

    Example:

    ```python
    dist = keras_autoshard.AutoShardDistribution()
    with dist.scope():
        model = keras_hub.models.GPT2Backbone(**config)
        model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, batch_size=8)      # plans on the first batch
    print(dist.plan.explain())
    ```
    """

    def __new__(cls, *args, **kwargs):
        if cls is AutoShardDistribution:
            # Other backends get the JAX class, whose constructor says why not.
            backend = keras.backend.backend()
            module_name, class_name = BACKEND_CLASSES.get(
                backend, BACKEND_CLASSES["jax"]
            )
            cls = getattr(importlib.import_module(module_name), class_name)
        return super().__new__(cls)
