"""PyTorch backend: `TensorParallel` builds a model from a function, a config
or a preset directory without a full copy on any rank: each rank allocates
its shards only, filled slice by slice from a weights file or from the
initializers (the same values on every rank). Outputs match one JAX process
holding the same weights."""

import numpy as np
import pytest

pytest.importorskip("torch")

from tests import torch_parity_worker as worker  # noqa: E402
from tests.torch_launch import rank_results, torchrun  # noqa: E402

WORKER = "torch_build_worker.py"


def _run(args, ranks, out_dir):
    done = torchrun(ranks, WORKER, args)
    results = rank_results(out_dir, ranks)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank, result in results.items():
        assert result is not None, (
            f"rank {rank} wrote no result:\n{done.stderr[-3000:]}"
        )
        assert result["ok"], result["problems"]
    return results


def _close_to_one_process(name, model, out_dir):
    x, _ = worker.batch(name)
    expected = np.asarray(model(x))
    predictions = np.load(out_dir / "predictions.npy")
    assert worker.relative(predictions, expected) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh_text", [("gpt2", "1x2"), ("mlp", "2x2")])
def test_a_builder_and_a_weights_file_give_each_rank_only_its_shards(
    name, mesh_text, tmp_path
):
    model = worker.build(name, seed=7)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    ranks = int(np.prod([int(s) for s in mesh_text.split("x")]))
    results = _run(["weights", name, mesh_text, str(tmp_path), path], ranks, tmp_path)
    _close_to_one_process(name, model, tmp_path)
    for result in results.values():
        # The model axis cuts the large kernels: no rank holds the model.
        assert result["parameter_bytes"] < 0.75 * result["model_bytes"], result


@pytest.mark.slow
def test_a_preset_directory_builds_sharded_and_loads_its_weights(tmp_path):
    backbone = worker.build("gpt2", seed=11)
    directory = tmp_path / "preset"
    backbone.save_to_preset(str(directory))
    results = _run(["preset", "1x2", str(tmp_path), str(directory)], 2, tmp_path)
    _close_to_one_process("gpt2", backbone, tmp_path)
    for result in results.values():
        assert result["parameter_bytes"] < 0.75 * result["model_bytes"], result


@pytest.mark.slow
def test_initializers_give_every_rank_the_same_values_without_a_full_model(tmp_path):
    _run(["init", "1x2", str(tmp_path)], 2, tmp_path)
    state = np.load(tmp_path / "init_state.npz")
    for path in state.files:
        value = state[path]
        if path.endswith("bias"):
            assert not value.any(), path
        else:  # glorot_uniform: std sqrt(2 / (fan_in + fan_out))
            expected = np.sqrt(2.0 / sum(value.shape))
            assert abs(value.std() / expected - 1) < 0.1, path
