"""One process of a multi-process JAX job (or the one-process reference).

Run by tests/runtime/test_multiprocess_jax.py:

    python tests/workers/multiprocess_jax_worker.py fit OUT --processes 2 --process-id I
        --port P --checkpoint DIR      # 2 processes x 4 simulated devices
    python tests/workers/multiprocess_jax_worker.py fit OUT --processes 1   # 1 x 8
    python tests/workers/multiprocess_jax_worker.py restore OUT --checkpoint DIR
    python tests/workers/multiprocess_jax_worker.py die OUT --processes 2 --process-id I
        --port P                       # process 1 is killed mid-training

Each writes a JSON result to OUT (per process).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

GLOBAL_BATCH = 16
STEPS = 5
FEATURES = 32


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["fit", "restore", "die"])
    parser.add_argument("out")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--mesh", default="2x4", help="batch x model")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = "jax"
    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    from tests import no_tensorflow

    no_tensorflow.hide()
    import keras_autoshard as ka

    ka.simulate_devices(8 // args.processes)
    spec = ka.distributed.initialize(
        f"localhost:{args.port}" if args.processes > 1 else None,
        num_processes=args.processes,
        process_id=args.process_id,
        heartbeat_timeout_s=10,
    )
    import jax
    import keras
    import numpy as np

    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, FEATURES)).astype("float32")
    y = rng.normal(size=(GLOBAL_BATCH * STEPS, 8)).astype("float32")

    def build():
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(128, activation="gelu", name="up")(inputs)
        hidden = keras.layers.Dense(64, activation="relu", name="mid")(hidden)
        outputs = keras.layers.Dense(8, name="down")(hidden)
        return keras.Model(inputs, outputs, name="mlp")

    mesh_shape = tuple(int(size) for size in args.mesh.split("x"))
    mesh = ka.MeshSpec(mesh_shape, ("batch", "model"))
    # Each process passes its own rows (numpy), so Keras must not shard again.
    dist = ka.AutoShardDistribution(device_mesh=mesh, auto_shard_dataset=False)
    result = {"spec": spec.describe(), "devices": jax.device_count()}
    with dist.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        if args.mode == "restore":
            model.build((None, FEATURES))
            dist.prepare(model, x[:GLOBAL_BATCH])
            ka.restore_checkpoint(model, args.checkpoint)
            result["weights"] = [np.asarray(w).tolist() for w in model.weights]
            result["plan"] = dist.plan.to_json()
            _write(args.out, result)
            return 0
        rows = ka.distributed.process_batch_rows(GLOBAL_BATCH, dist)
        local_x, local_y = (
            np.concatenate(
                [a[i : i + GLOBAL_BATCH][rows] for i in range(0, len(a), GLOBAL_BATCH)]
            )
            for a in (x, y)
        )
        result["rows"] = [rows.start, rows.stop]
        result["local_rows"] = int(len(local_x))
        callbacks = []
        if args.mode == "die":
            callbacks.append(_DieAt(step=2, process_id=args.process_id))
        started = time.monotonic()
        try:
            history = model.fit(
                local_x,
                local_y,
                batch_size=rows.stop - rows.start,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=[_StepLosses(result), *callbacks],
            )
        except Exception as error:  # the survivor of a dead peer reports here
            result["error"] = f"{type(error).__name__}: {error}"
            result["error_after_s"] = time.monotonic() - started
            _write(args.out, result)
            return 3
        result["epoch_loss"] = float(history.history["loss"][-1])
        result["plan"] = dist.plan.to_json()
        result["parameter_shard_elements"] = {
            v.path: int(np.prod(v.value.addressable_shards[0].data.shape))
            for v in model.trainable_variables
        }
        result["weights"] = [np.asarray(_gather(w)).tolist() for w in model.weights]
        if args.checkpoint:
            ka.save_checkpoint(model, args.checkpoint, step=STEPS)
    _write(args.out, result)
    return 0


def _gather(variable):
    from jax.experimental import multihost_utils

    value = variable.value
    if value.is_fully_addressable:
        return value
    return multihost_utils.process_allgather(value, tiled=True)


class _StepLosses:
    """Keras callback recording the running loss after every batch."""

    def __new__(cls, result):
        import keras

        class StepLosses(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                result.setdefault("losses", []).append(float(logs["loss"]))

        return StepLosses()


class _DieAt:
    def __new__(cls, step, process_id):
        import keras

        class DieAt(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if batch == step and process_id == 1:
                    os.kill(os.getpid(), signal.SIGKILL)

        return DieAt()


def _write(path, result):
    with open(path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    sys.exit(main())
