"""PyTorch backend: `.weights.h5` and safetensors files move between the
torch wrapper on torchrun ranks and one JAX process, both ways, bit for bit;
each rank reads only its shards' blocks; another model's file is a clear
error on every rank."""

import os

import keras
import numpy as np
import pytest

import keras_autoshard as ka

pytest.importorskip("torch")

from tests import torch_parity_worker as worker  # noqa: E402
from tests.torch_launch import rank_results, torchrun  # noqa: E402

CASES = [("mlp", "1x2"), ("mlp", "2x2"), ("gpt2", "1x2")]


def _global_inputs(name):
    x, _ = worker.batch(name)
    return x


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh_text", CASES)
def test_weights_files_move_between_torch_ranks_and_jax_bit_exactly(
    name, mesh_text, tmp_path
):
    ranks = int(np.prod([int(s) for s in mesh_text.split("x")]))
    jax_model = worker.build(name, seed=7)
    jax_file = str(tmp_path / "jax.weights.h5")
    jax_model.save_weights(jax_file)
    ka.save_safetensors(jax_model, str(tmp_path / "jax.safetensors"))

    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
    bad_file = str(tmp_path / "other.weights.h5")
    other.save_weights(bad_file)

    done = torchrun(
        ranks,
        "torch_weights_worker.py",
        [name, mesh_text, str(tmp_path), jax_file, bad_file],
    )
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
