"""PyTorch backend: `.weights.h5` and safetensors files move between the
torch wrapper on torchrun ranks and one JAX process, both ways, bit for bit;
each rank reads only its shards' blocks; another model's file is a clear
error on every rank."""

import json
import os

import keras
import numpy as np
import pytest

import keras_autoshard as ka

pytest.importorskip("torch")

from tests.workers import torch_parity_worker as worker  # noqa: E402
from tests.workers.torch_launch import rank_results, torchrun  # noqa: E402

CASES = [("mlp", "1x2"), ("mlp", "2x2"), ("gpt2", "1x2")]


def _global_inputs(name):
    x, _ = worker.batch(name)
    return x


def _prepare(name, folder) -> list[str]:
    """Write the JAX model's files and another model's into `folder`; the
    worker's arguments for `name`."""
    jax_model = worker.build(name, seed=7)
    jax_file = str(folder / "jax.weights.h5")
    jax_model.save_weights(jax_file)
    ka.save_safetensors(jax_model, str(folder / "jax.safetensors"))
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
    bad_file = str(folder / "other.weights.h5")
    other.save_weights(bad_file)
    return [jax_file, bad_file]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """`{(name, mesh): (torchrun's result, folder)}`: one launch per mesh,
    every model of that mesh in it, each in its own folder."""
    found = {}
    for mesh_text in dict.fromkeys(mesh for _, mesh in CASES):
        ranks = int(np.prod([int(s) for s in mesh_text.split("x")]))
        jobs, folders = [], {}
        for name in (n for n, mesh in CASES if mesh == mesh_text):
            folder = tmp_path_factory.mktemp(f"{name}_{mesh_text}")
            jobs.append([name, mesh_text, str(folder), *_prepare(name, folder)])
            folders[name] = folder
        done = torchrun(ranks, "torch_weights_worker.py", ["jobs", json.dumps(jobs)])
        for name, folder in folders.items():
            found[(name, mesh_text)] = (done, folder)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh_text", CASES)
def test_weights_files_move_between_torch_ranks_and_jax_bit_exactly(
    name, mesh_text, launches
):
    ranks = int(np.prod([int(s) for s in mesh_text.split("x")]))
    done, tmp_path = launches[(name, mesh_text)]
    results = rank_results(tmp_path, ranks)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank, result in results.items():
        assert result is not None, (
            f"rank {rank} wrote no result:\n{done.stderr[-3000:]}"
        )
        assert result["ok"], result["problems"]
        # Slices only: with the model axis cutting the large kernels, no rank
        # reads the whole model.
        assert result["bytes_read"] < result["model_bytes"], result

    # torch → JAX: plain Keras loads the wrapper's file on one process.
    loaded = worker.build(name, seed=3)
    loaded.load_weights(str(tmp_path / "torch.weights.h5"))
    state = np.load(tmp_path / "torch_state.npz")
    assert sorted(state.files) == sorted(v.path for v in loaded.variables)
    for variable in loaded.variables:
        assert np.array_equal(np.asarray(variable.value), state[variable.path]), (
            variable.path
        )
    from_safetensors = worker.build(name, seed=4)
    ka.load_weights_sharded(from_safetensors, tmp_path / "torch.safetensors")
    for variable in from_safetensors.variables:
        assert np.array_equal(np.asarray(variable.value), state[variable.path]), (
            variable.path
        )
    predictions = np.load(tmp_path / "torch_predictions.npy")
    expected = np.asarray(loaded(_global_inputs(name)))
    error = np.max(np.abs(predictions - expected)) / np.max(np.abs(expected))
    assert error <= 1e-6, error
    assert not os.path.exists(tmp_path / "torch.weights.h5.partial")
