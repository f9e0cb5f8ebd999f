"""PyTorch backend: `TensorParallel` builds a model from a function, a config
or a preset directory without a full copy on any rank: each rank allocates
its shards only, filled slice by slice from a weights file or from the
initializers (the same values on every rank). Outputs match one JAX process
holding the same weights."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from tests.workers import torch_parity_worker as worker  # noqa: E402
from tests.workers.torch_launch import rank_results, torchrun  # noqa: E402

WORKER = "torch_build_worker.py"


# The jobs on two ranks (1x2) run in one launch, each in its own folder.
ONE_BY_TWO = ("weights", "preset", "init")


@pytest.fixture(scope="module")
def one_by_two(tmp_path_factory):
    """`{job: (folder, the model the job's outputs are compared with)}`
    after one torchrun launch of the 1x2 jobs, and that launch."""
    folders = {job: tmp_path_factory.mktemp(job) for job in ONE_BY_TWO}
    weights_model = worker.build("gpt2", seed=7)
    weights_file = str(folders["weights"] / "model.weights.h5")
    weights_model.save_weights(weights_file)
    preset_model = worker.build("gpt2", seed=11)
    preset = folders["preset"] / "preset"
    preset_model.save_to_preset(str(preset))
    jobs = [
        ["weights", "gpt2", "1x2", str(folders["weights"]), weights_file],
        ["preset", "1x2", str(folders["preset"]), str(preset)],
        ["init", "1x2", str(folders["init"])],
    ]
    done = torchrun(2, WORKER, ["jobs", json.dumps(jobs)])
    models = {"weights": weights_model, "preset": preset_model, "init": None}
    return done, {job: (folders[job], models[job]) for job in ONE_BY_TWO}


def _results(done, out_dir, ranks):
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


def _each_rank_holds_only_its_shards(results):
    for result in results.values():
        # The model axis cuts the large kernels: no rank holds the model.
        assert result["parameter_bytes"] < 0.75 * result["model_bytes"], result


def _gpt2_job_matches_one_process(one_by_two, job):
    """A 1x2 job's ranks reported no problem, predict as one process with
    the job's weights, and hold only their shards."""
    done, jobs = one_by_two
    out_dir, model = jobs[job]
    results = _results(done, out_dir, 2)
    _close_to_one_process("gpt2", model, out_dir)
    _each_rank_holds_only_its_shards(results)


@pytest.mark.slow
def test_a_builder_and_a_weights_file_give_each_rank_only_its_shards(one_by_two):
    _gpt2_job_matches_one_process(one_by_two, "weights")


@pytest.mark.slow
def test_a_builder_and_a_weights_file_on_2x2(tmp_path):
    model = worker.build("mlp", seed=7)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    done = torchrun(4, WORKER, ["weights", "mlp", "2x2", str(tmp_path), path])
    results = _results(done, tmp_path, 4)
    _close_to_one_process("mlp", model, tmp_path)
    _each_rank_holds_only_its_shards(results)


@pytest.mark.slow
def test_a_preset_directory_builds_sharded_and_loads_its_weights(one_by_two):
    _gpt2_job_matches_one_process(one_by_two, "preset")


@pytest.mark.slow
def test_initializers_give_every_rank_the_same_values_without_a_full_model(
    one_by_two,
):
    done, jobs = one_by_two
    out_dir, _ = jobs["init"]
    _results(done, out_dir, 2)
    state = np.load(out_dir / "init_state.npz")
    for path in state.files:
        value = state[path]
        if path.endswith("bias"):
            assert not value.any(), path
        else:  # glorot_uniform: std sqrt(2 / (fan_in + fan_out))
            expected = np.sqrt(2.0 / sum(value.shape))
            assert abs(value.std() / expected - 1) < 0.1, path
