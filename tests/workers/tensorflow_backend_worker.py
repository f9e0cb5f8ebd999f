"""The TensorFlow-backend side of tests/apply/tensorflow/test_tensorflow_backend.py.

Run as `python tests/workers/tensorflow_backend_worker.py DEVICES OUT.json` with
`KERAS_BACKEND=tensorflow`: splits the CPU into DEVICES logical devices, then
- trains each model 5 Adam steps on one device and data parallel over all
  devices (`TensorParallel(world_size=1)` given a built model or a builder,
  and the MLP also under `AutoShardDistribution().scope()`), from the same
  initial weights and with an optimizer made outside the strategy scope;
- plans the Embedding+EinsumDense model on a (2, 2) mesh;
- asks for tensor parallelism three ways and records the errors, and the
  error of `keras_autoshard.plan` in this (TensorFlow) process;
and writes everything as JSON. The test (a JAX process) judges the figures.

Importing this module (as the test does, for `build` and `batch`) does not
import TensorFlow.
"""

import json
import os
import sys
import time

STEPS = 5
BATCH = 8
MODELS = ("mlp", "embed_einsum")


def build(name):
    """The model `name`, with fixed layer names and seeded weights."""
    import keras

    keras.utils.set_random_seed(0)
    if name == "mlp":
        inputs = keras.Input((16,), name="features")
        hidden = keras.layers.Dense(32, activation="relu", name="up")(inputs)
        return keras.Model(inputs, keras.layers.Dense(8, name="down")(hidden))
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(50, 16, name="embed")(tokens)
    heads = keras.layers.EinsumDense(
        "bsd,dhk->bshk", (6, 4, 8), bias_axes="hk", name="heads"
    )(embedded)
    merged = keras.layers.Reshape((6, 32), name="merge")(heads)
    return keras.Model(tokens, keras.layers.Dense(8, name="out")(merged))


def batch(name):
    """One fixed global batch (x, y) for model `name`."""
    import numpy as np

    rng = np.random.default_rng(1)
    if name == "mlp":
        x = rng.normal(size=(BATCH, 16)).astype("float32")
        return x, rng.normal(size=(BATCH, 8)).astype("float32")
    x = rng.integers(0, 50, size=(BATCH, 6)).astype("int32")
    return x, rng.normal(size=(BATCH, 6, 8)).astype("float32")


def fit_losses(model, name):
    import keras

    x, y = batch(name)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=STEPS, shuffle=False, verbose=0)
    return history.history["loss"]


def error_of(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type is part of the result
        return {
            "type": type(error).__name__,
            "bases": [cls.__name__ for cls in type(error).__mro__],
            "message": str(error),
        }
    return None


def main(devices, out_path):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(devices)]
    )
    import keras

    import keras_autoshard as ka
    from keras_autoshard.apply.tensorflow.data_parallel import (
        check_data_parallel_plan,
    )
    from keras_autoshard.apply.tensorflow.planning import plan_for_tensorflow

    result = {"devices": keras.distribution.list_devices(), "models": {}}
    for name in MODELS:
        started = time.perf_counter()
        reference = build(name)
        weights = reference.get_weights()
        single = fit_losses(reference, name)
        if name == "mlp":
            # A model built outside any strategy scope: rebuilt inside it.
            wrapper = ka.TensorParallel(build(name), world_size=1)
        else:
            wrapper = ka.TensorParallel(lambda name=name: build(name), world_size=1)
        wrapper.wrapped_model.set_weights(weights)
        parallel = fit_losses(wrapper, name)
        result["models"][name] = {
            "single_device": single,
            "tensor_parallel_world_size_1": parallel,
            "wrapper": type(wrapper).__name__,
            "is_tensor_parallel": isinstance(wrapper, ka.TensorParallel),
            "replicas": wrapper.strategy.num_replicas_in_sync,
            "mirrored_variables": sum(
                isinstance(v.value, tf.distribute.DistributedValues)
                for v in wrapper.wrapped_model.variables
            ),
            "variables": len(wrapper.wrapped_model.variables),
            "plan": wrapper.plan.to_json(),
            "seconds": time.perf_counter() - started,
        }

    distribution = ka.AutoShardDistribution()
    with distribution.scope():
        model = build("mlp")
        model.set_weights(build("mlp").get_weights())
        scoped = fit_losses(model, "mlp")
    distribution.prepare(model, batch("mlp")[0])
    result["distribution"] = {
        "type": type(distribution).__name__,
        "is_auto_shard_distribution": isinstance(
            distribution, ka.AutoShardDistribution
        ),
        "losses": scoped,
        "mesh": list(distribution.plan.mesh.shape),
        "replicated": all(not any(v.spec) for v in distribution.plan.variables),
    }

    x, _ = batch("embed_einsum")
    model_parallel_plan = plan_for_tensorflow(
        build("embed_einsum"), ka.MeshSpec((2, 2), ("batch", "model")), x
    )
    result["model_parallel_plan"] = model_parallel_plan.to_json()
    result["errors"] = {
        "tensor_parallel_world_size_2": error_of(
            lambda: ka.TensorParallel(lambda: build("mlp"), world_size=2)
        ),
        "tensor_parallel_default_world_size": error_of(
            lambda: ka.TensorParallel(lambda: build("mlp"))
        ),
        "distribution_model_axis_2": error_of(
            lambda: ka.AutoShardDistribution(
                device_mesh=ka.MeshSpec((1, 2), ("batch", "model"))
            )
        ),
        "model_parallel_plan": error_of(
            lambda: check_data_parallel_plan(model_parallel_plan)
        ),
        # keras_autoshard.plan traces with JAX, in this TensorFlow process.
        "plan_in_this_process": error_of(
            lambda: ka.plan(
                build("mlp"),
                ka.MeshSpec((devices, 1), ("batch", "model")),
                sample_input=batch("mlp")[0],
            )
        ),
    }
    result["keras_backend"] = keras.backend.backend()
    with open(out_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "tensorflow"
    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    main(int(sys.argv[1]), sys.argv[2])
