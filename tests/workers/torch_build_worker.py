"""One torchrun rank of the PyTorch-backend build-without-a-full-copy test.

Modes:
- `weights NAME DxM OUT FILE`: `TensorParallel(builder, weights=FILE)`: the
  model is built abstractly and each rank's shards are filled from FILE;
  every local block is compared with the file bit for bit; rank 0 writes
  `predictions.npy` (outputs for the global batch). Then the wrapper's config
  goes through JSON and `TensorParallel.from_config` gives a wrapper with the
  same plan, which `load_weights(FILE)` fills: the same predictions.
- `preset DxM OUT DIR`: `TensorParallel(DIR)` for a KerasHub preset directory
  (GPT-2): blocks compared with `DIR/model.weights.h5`; `predictions.npy`.
- `init DxM OUT`: two wrappers of the MLP builder with `init_seed=5` and no
  weights: the same values on every rank and in both; rank 0 writes
  `init_state.npz`. A builder that loads weights is refused.

Each rank writes `rank<r>.json`: {"ok", "problems", "parameter_bytes",
"model_bytes"}.

Usage: torchrun --nproc-per-node N tests/workers/torch_build_worker.py MODE ...
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

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import keras_autoshard as ka  # noqa: E402
from keras_autoshard.io.torch.dtensor_shards import full_numpy  # noqa: E402
from tests.workers.torch_launch import finish_rank  # noqa: E402
from tests.workers.torch_parity_worker import batch, build  # noqa: E402
from tests.workers.torch_weights_worker import compare_with_file, rows_of_rank  # noqa: E402


def mesh_of(text: str) -> ka.MeshSpec:
    return ka.MeshSpec(tuple(int(s) for s in text.split("x")), ("batch", "model"))


def local_inputs(name: str, mesh: ka.MeshSpec):
    x, _ = batch(name)
    rows = rows_of_rank(int(os.environ["RANK"]), mesh)
    return {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]


def sizes(tp) -> dict:
    model_bytes = sum(int(np.prod(v.shape)) * 4 for v in tp.wrapped_model.variables)
    return {"parameter_bytes": tp.state_bytes().parameters, "model_bytes": model_bytes}


def predict(tp, x) -> np.ndarray:
    return keras.ops.convert_to_numpy(tp.predict_on_batch(x))


def run_weights(name, mesh_text, out_dir, path) -> dict:
    mesh = mesh_of(mesh_text)
    x = local_inputs(name, mesh)
    tp = ka.TensorParallel(
        lambda: build(name),
        world_size=mesh.axis_size("model"),
        distributed_backend="torch",
        weights=path,
        sample_input=x,
    )
    problems = compare_with_file(tp.wrapped_model, path, "built from the file")
    predictions = predict(tp, x)
    config = json.loads(json.dumps(tp.get_config()))
    again = ka.TensorParallel.from_config(config)
    if again.plan.to_dict() != tp.plan.to_dict():
        problems.append("from_config gave another plan")
    again.load_weights(path)
    problems += compare_with_file(again.wrapped_model, path, "from_config + load")
    if not np.array_equal(predict(again, x), predictions):
        problems.append("from_config's wrapper predicts otherwise")
    if torch.distributed.get_rank() == 0:
        np.save(os.path.join(out_dir, "predictions.npy"), predictions)
    return {"ok": not problems, "problems": problems, **sizes(tp)}


def run_preset(mesh_text, out_dir, directory) -> dict:
    mesh = mesh_of(mesh_text)
    x = local_inputs("gpt2", mesh)
    tp = ka.TensorParallel(
        directory,
        world_size=mesh.axis_size("model"),
        distributed_backend="torch",
        sample_input=x,
    )
    weights = os.path.join(directory, "model.weights.h5")
    problems = compare_with_file(tp.wrapped_model, weights, "the preset")
    predictions = predict(tp, x)
    if torch.distributed.get_rank() == 0:
        np.save(os.path.join(out_dir, "predictions.npy"), predictions)
    return {"ok": not problems, "problems": problems, **sizes(tp)}


def run_init(mesh_text, out_dir) -> dict:
    mesh = mesh_of(mesh_text)
    x = local_inputs("mlp", mesh)
    states = []
    for _ in range(2):
        tp = ka.TensorParallel(
            lambda: build("mlp"),
            world_size=mesh.axis_size("model"),
            distributed_backend="torch",
            init_seed=5,
            sample_input=x,
        )
        states.append({v.path: full_numpy(v.value) for v in tp.wrapped_model.variables})
    problems = [
        f"{path} differs between two builds with one seed"
        for path in states[0]
        if not np.array_equal(states[0][path], states[1][path])
    ]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, states[0])
    for rank, state in enumerate(everyone):
        problems += [
            f"{path} differs on rank {rank}"
            for path in state
            if not np.array_equal(state[path], states[0][path])
        ]

    def loads_weights():
        model = build("mlp")
        model.set_weights([np.ones(v.shape, "float32") for v in model.weights])
        return model

    try:
        ka.TensorParallel(loads_weights, distributed_backend="torch")
        problems.append("a builder that loads weights was accepted")
    except ka.errors.TensorParallelError as error:
        if "assigned" not in str(error) or "weights=" not in str(error):
            problems.append(f"unclear error for a loading builder: {error}")
    if torch.distributed.get_rank() == 0:
        np.savez(os.path.join(out_dir, "init_state.npz"), **states[0])
    return {"ok": not problems, "problems": problems, **sizes(tp)}


def run_job(mode: str, args: list[str]) -> None:
    """One job (`weights`, `preset` or `init`): its figures into its
    folder's `rank<r>.json`."""
    out_dir = args[2] if mode == "weights" else args[1]
    rank = int(os.environ.get("RANK", "0"))
    try:
        if mode == "weights":
            result = run_weights(*args)
        elif mode == "preset":
            result = run_preset(*args)
        else:
            result = run_init(*args)
    except Exception:
        result = {"ok": False, "problems": [traceback.format_exc()]}
    finish_rank(out_dir, rank, result)


if __name__ == "__main__":
    # `jobs '<JSON list of [mode, *args]>'`: several jobs in one launch (the
    # ranks' imports and process group paid once), or one job's arguments.
    mode, *args = sys.argv[1:]
    for job in json.loads(args[0]) if mode == "jobs" else [[mode, *args]]:
        run_job(job[0], job[1:])
