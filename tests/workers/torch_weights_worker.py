"""One torchrun rank of the PyTorch-backend weights-file test.

Wraps a model in `TensorParallel(..., distributed_backend="torch")`, trains 3
steps on this rank's rows, then:

1. `tp.save_weights(OUT/torch.weights.h5)` and `OUT/torch.safetensors` (every
   rank, one path each), and writes
   `OUT/torch_state.npz` (every variable gathered, by path) and
   `OUT/torch_predictions.npy` (outputs for the global batch) from rank 0;
2. `tp.load_weights(JAX_FILE)`: every rank compares its local shards with the
   same block read from the file, bit for bit, and records the bytes read;
3. scrambles the weights, then `keras_autoshard.load_weights_sharded(tp,
   JAX_FILE)`: compared again; then again from JAX's safetensors file (JAX_FILE
   with the suffix `.safetensors`);
4. `tp.load_weights(BAD_FILE)` (another model's file): a `CheckpointError`
   naming the file and a variable on every rank, the weights untouched.

Writes `rank<r>.json`: {"ok": bool, "problems": [...], "bytes_read": ...}.

Usage: torchrun --nproc-per-node N tests/workers/torch_weights_worker.py MODEL DxM OUT
    JAX_FILE BAD_FILE
"""

import json
import os
import sys
import traceback

if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    from tests import no_tensorflow

    no_tensorflow.hide()

import h5py  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import keras_autoshard as ka  # noqa: E402
from keras_autoshard.io.keras_weights_layout import keras_h5_keys  # noqa: E402
from keras_autoshard.io.torch.dtensor_shards import (  # noqa: E402
    full_numpy,
    is_dtensor,
    local_slice_index,
)
from tests.workers.torch_launch import finish_rank  # noqa: E402
from tests.workers.torch_parity_worker import BATCH, adam, batch, build  # noqa: E402

TRAIN_STEPS = 3


def local_blocks(model) -> dict[str, tuple[tuple[slice, ...], np.ndarray]]:
    """Dataset key → (index, this rank's block) of every variable."""
    blocks = {}
    for key, variable in keras_h5_keys(model).items():
        value = variable.value
        if is_dtensor(value):
            index = local_slice_index(value)
            local = value.to_local()
        else:
            index = tuple(slice(0, s) for s in value.shape)
            local = value
        blocks[key] = (index, local.detach().cpu().numpy().copy())
    return blocks


def compare_with_file(model, path, what) -> list[str]:
    problems = []
    with h5py.File(path, "r") as weights:
        for key, (index, block) in local_blocks(model).items():
            expected = weights[key][index]
            if block.shape != expected.shape or not np.array_equal(block, expected):
                problems.append(f"{what}: {key} differs from the file")
    return problems


def rows_of_rank(rank: int, mesh: ka.MeshSpec) -> slice:
    model_ways = mesh.axis_size("model")
    data = mesh.axis_size("batch")
    index = rank // model_ways
    return slice(index * BATCH // data, (index + 1) * BATCH // data)


def scramble(tp) -> None:
    for variable in tp.wrapped_model.variables:
        local = variable.value.to_local() if is_dtensor(variable.value) else None
        with torch.no_grad():
            (local if local is not None else variable.value).fill_(7.0)


def run(name: str, mesh_text: str, out_dir: str, jax_file: str, bad_file: str) -> dict:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    mesh = ka.MeshSpec(tuple(int(s) for s in mesh_text.split("x")), ("batch", "model"))
    x, y = batch(name)
    rows = rows_of_rank(int(os.environ["RANK"]), mesh)
    local_x = {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]
    tp = ka.TensorParallel(
        build(name), world_size=mesh.axis_size("model"), distributed_backend="torch"
    )
    rank = torch.distributed.get_rank()
    tp.compile(optimizer=adam(), loss="mse")
    for _ in range(TRAIN_STEPS):
        tp.train_on_batch(local_x, y[rows])
    path = os.path.join(out_dir, "torch.weights.h5")
    tp.save_weights(path)
    tp.save_weights(os.path.join(out_dir, "torch.safetensors"))
    state = {v.path: full_numpy(v.value) for v in tp.wrapped_model.variables}
    predictions = keras.ops.convert_to_numpy(tp.predict_on_batch(local_x))
    if rank == 0:
        np.savez(os.path.join(out_dir, "torch_state.npz"), **state)
        np.save(os.path.join(out_dir, "torch_predictions.npy"), predictions)
    problems = []
    if not os.path.exists(path):
        problems.append(f"rank {rank}: {path} missing after save_weights returned")

    tp.load_weights(jax_file)
    problems += compare_with_file(tp.wrapped_model, jax_file, "tp.load_weights")
    scramble(tp)
    report = ka.load_weights_sharded(tp, jax_file)
    problems += compare_with_file(tp.wrapped_model, jax_file, "load_weights_sharded")
    scramble(tp)
    ka.load_weights_sharded(tp, jax_file.replace(".weights.h5", ".safetensors"))
    problems += compare_with_file(tp.wrapped_model, jax_file, "JAX's safetensors")
    try:
        tp.load_weights(bad_file)
        problems.append("loading another model's file raised nothing")
    except ka.errors.CheckpointError as error:
        if bad_file not in str(error) or "/kernel" not in str(error):
            problems.append(f"the error names no file or variable: {error}")
    problems += compare_with_file(tp.wrapped_model, jax_file, "after the bad file")
    total = sum(int(np.prod(v.shape)) * 4 for v in tp.wrapped_model.variables)
    return {
        "ok": not problems,
        "problems": problems,
        "bytes_read": report.bytes_read,
        "model_bytes": total,
        "variables_loaded": report.variables_loaded,
    }


def run_job(name, mesh_text, out_dir, jax_file, bad_file) -> None:
    """One model's checks; its figures into its folder's `rank<r>.json`."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run(name, mesh_text, out_dir, jax_file, bad_file)
    except Exception:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "problems": [traceback.format_exc()]}
    finish_rank(out_dir, rank, result)


if __name__ == "__main__":
    # `jobs '<JSON list of [name, mesh, out_dir, jax_file, bad_file]>'`:
    # several models in one launch (imports and process group paid once).
    if sys.argv[1] == "jobs":
        for job in json.loads(sys.argv[2]):
            run_job(*job)
    else:
        run_job(*sys.argv[1:6])
