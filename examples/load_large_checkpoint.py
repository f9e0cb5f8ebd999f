"""Load a large checkpoint onto a sharded model with bounded host memory.

`load_weights_sharded` reads each device's slice of each variable straight
from the file (an HDF5 hyperslab) and places it on that device, so the host
never holds more than one slice, and no device ever holds a whole weight it
does not need. This script:

1. writes a `.weights.h5` checkpoint of a stack of wide Dense layers (in a
   child process, as if someone else had trained it);
2. plans the model for the mesh without allocating any weight;
3. creates the model under the plan (every variable born sharded) and loads
   the file slice by slice, with a progress bar;
4. checks a few values against the file, prints the largest single read
   next to the checkpoint size, and saves an Orbax checkpoint shard by shard.

    python examples/load_large_checkpoint.py                  # ~64 MiB
    python examples/load_large_checkpoint.py --size-mib 2048  # 2 GiB
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_autoshard as ka  # noqa: E402

WIDTH = 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=float, default=64)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--mesh", default="1x8", help="data x model, e.g. 1x8")
    parser.add_argument("--dir", default=None, help="working directory (temp)")
    parser.add_argument("--write-only", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def layer_count(size_mib: float, width: int) -> int:
    return max(1, round(size_mib * 2**20 / (4 * width * width)))


def build(layers: int, width: int):
    import keras

    inputs = keras.Input((width,), name="x")
    x = inputs
    for i in range(layers):
        x = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(x)
    return keras.Model(inputs, x, name="wide_stack")


def write_checkpoint(path: str, layers: int, width: int) -> None:
    """The checkpoint another job produced: a plain Keras weights file."""
    import keras

    keras.utils.set_random_seed(0)
    build(layers, width).save_weights(path)


def main() -> None:
    args = parse_args()
    layers = layer_count(args.size_mib, args.width)
    if args.write_only:
        write_checkpoint(args.write_only, layers, args.width)
        return
    data_size, model_size = (int(s) for s in args.mesh.split("x"))
    ka.simulate_devices(data_size * model_size)  # before JAX starts

    with tempfile.TemporaryDirectory(dir=args.dir) as workdir:
        path = os.path.join(workdir, "model.weights.h5")
        subprocess.run(
            [sys.executable, __file__, "--write-only", path]
            + ["--size-mib", str(args.size_mib), "--width", str(args.width)],
            check=True,
        )
        file_mib = os.path.getsize(path) / 2**20
        print(f"Wrote {path}: {file_mib:.1f} MiB, {layers} Dense layers")

        import h5py
        import numpy as np

        sample = np.zeros((8 * data_size, args.width), "float32")
        mesh = ka.MeshSpec((data_size, model_size), ("batch", "model"))
        plan = ka.plan(lambda: build(layers, args.width), mesh, sample_input=sample)
        print(plan.summary(max_rows=6))

        with ka.PlanDistribution(plan).scope():
            model = build(layers, args.width)
            report = ka.load_weights_sharded(model, path, progress=True)

            kernel = model.get_layer("dense_0").kernel
            with h5py.File(path) as stored:
                # Keras names the file's groups by layer type and order.
                expected = stored["layers/dense/vars/0"][:4, :4]
            assert np.array_equal(np.asarray(kernel.value)[:4, :4], expected)
            print(f"dense_0/kernel sharding: {kernel.value.sharding.spec}")
            print(
                f"Loaded {report.variables_loaded} variables "
                f"({report.bytes_read / 2**20:.1f} MiB read in "
                f"{report.seconds:.2f} s); largest single read "
                f"{report.max_read_bytes / 2**20:.2f} MiB of a "
                f"{file_mib:.1f} MiB checkpoint"
            )
            ckpt = os.path.join(workdir, "orbax")
            ka.save_checkpoint(model, ckpt, step=1, plan=plan)
            steps = ka.ShardedCheckpoint.complete_steps(ckpt)
            print(f"Saved an Orbax checkpoint shard by shard: steps {steps}")


if __name__ == "__main__":
    main()
