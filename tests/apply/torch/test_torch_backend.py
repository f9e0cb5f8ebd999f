"""PyTorch backend under torchrun (gloo, CPU): parity with one process, the
same plan as JAX, per-rank bytes, and a killed rank stopping the others."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("torch")

import keras_autoshard as ka  # noqa: E402
from keras_autoshard import MeshSpec  # noqa: E402
from keras_autoshard.errors import PlanError  # noqa: E402
from keras_autoshard.planner.subprocess_planning import align_plan  # noqa: E402
from keras_autoshard.runtime.torch_processes import (  # noqa: E402
    TorchSetupError,
    ensure_process_group,
)
from tests.workers import torch_parity_worker as worker  # noqa: E402
from tests.xla_flags import child_env  # noqa: E402

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
WORKER = os.path.join(ROOT, "tests", "workers", "torch_parity_worker.py")
RUN_TIMEOUT_S = 240
_RUNS: dict = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    ranks: int, args: list[str], out_dir, mode: str = "parity"
) -> subprocess.CompletedProcess:
    env = child_env(KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={ranks}", f"--master-port={_free_port()}",
        WORKER, *args, str(out_dir), mode,
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S
    )


CASES = [("mlp", "1x2"), ("mlp", "2x2"), ("gpt2", "1x2"), ("gpt2", "2x2")]
# The `TensorParallel` wrapper's run and the multi-axis plan's share this
# mesh's parity launch (each launch costs its ranks' imports, about 7
# CPU-seconds a rank).
TENSOR_PARALLEL_MESH = "2x2"


def parity_run(name, mesh_text, tmp_path_factory):
    """`(torchrun's result, {rank: figures}, output folder)` of `name` on
    `mesh_text`. One launch per mesh checks every case of that mesh (the
    ranks' imports and process group are paid once)."""
    if mesh_text not in _RUNS:
        names = [case for case, mesh in CASES if mesh == mesh_text]
        out = tmp_path_factory.mktemp(f"parity_{mesh_text}")
        ranks = int(np.prod([int(s) for s in mesh_text.split("x")]))
        mode = (
            "parity,multi_axis,tensor_parallel"
            if mesh_text == TENSOR_PARALLEL_MESH
            else "parity"
        )
        _RUNS[mesh_text] = (
            torchrun(ranks, [",".join(names), mesh_text], out, mode),
            out,
        )
    done, out = _RUNS[mesh_text]
    ranks = int(np.prod([int(s) for s in mesh_text.split("x")]))
    results = {}
    for rank in range(ranks):
        path = out / f"{name}_rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else None
    return done, results, out


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh_text", CASES)
def test_torch_ranks_match_one_process_forward_gradients_and_5_adam_steps(
    name, mesh_text, tmp_path_factory
):
    done, results, _ = parity_run(name, mesh_text, tmp_path_factory)
    missing = [rank for rank, result in results.items() if result is None]
    assert not missing, f"ranks {missing} wrote no result:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, done.stderr[-4000:]
    for rank, result in results.items():
        assert result["ok"], f"rank {rank}: {result['problems']}"
        # Parameter bytes: the sharded part cut over the model axis, plus the
        # replicated remainder (checked exactly inside the worker).
        assert result["parameters"] == result["expected_parameters"]
        assert result["optimizer"] < 2 * result["sharded_total"]


@pytest.mark.slow
def test_torch_plan_is_the_plan_jax_makes_for_the_same_model(tmp_path_factory):
    _, results, out = parity_run("gpt2", "2x2", tmp_path_factory)
    torch_plan = ka.ShardingPlan.load(str(out / "gpt2_plan.json"))
    x, _ = worker.batch("gpt2")
    mesh = MeshSpec((2, 2), ("batch", "model"))
    jax_plan = ka.plan(lambda: worker.build("gpt2"), mesh, sample_input=x)

    def entries(plan):
        return sorted(
            (re.sub(r"_\d+(?=/|$)", "", v.path), v.shape, v.spec)
            for v in plan.variables
        )

    assert entries(torch_plan) == entries(jax_plan)
    assert torch_plan.batch_axis == jax_plan.batch_axis == "batch"
    assert any("model" in v.spec for v in torch_plan.variables)


@pytest.mark.slow
def test_killed_rank_stops_the_others_within_60_seconds(tmp_path):
    started = time.time()
    done = torchrun(2, ["mlp", "1x2"], tmp_path, mode="kill")
    ended = time.time()
    killed_at = float((tmp_path / "killed_at").read_text())
    assert done.returncode != 0
    assert ended - killed_at < 60, f"stopped {ended - killed_at:.1f} s after the kill"
    assert "SIGKILL" in done.stderr and "rank      : 1" in done.stderr
    assert ended - started < RUN_TIMEOUT_S


def test_no_process_group_and_no_torchrun_environment_is_an_error(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TorchSetupError, match="torchrun --nproc-per-node"):
        ensure_process_group()


def test_plan_from_another_model_is_rejected_naming_the_variable():
    import keras

    def mlp(width):
        inputs = keras.Input((8,))
        return keras.Model(inputs, keras.layers.Dense(width, name="out")(inputs))

    planned = mlp(4)
    plan = ka.plan(planned, MeshSpec((1, 2), ("batch", "model")), np.zeros((2, 8)))
    paths = [v.path for v in planned.variables]
    with pytest.raises(PlanError, match="out/kernel.*has shape"):
        align_plan(plan, paths, mlp(6))
    with pytest.raises(PlanError, match="1 variables"):
        align_plan(plan, paths[:1], mlp(4))


@pytest.mark.slow
def test_tensor_parallel_with_torch_backend_trains_like_the_unwrapped_model(
    tmp_path_factory,
):
    # The seed README's Sequential example on 4 ranks: 2-way TP x 2-way data,
    # run after the 2x2 parity cases in their launch.
    done, _, out = parity_run("mlp", TENSOR_PARALLEL_MESH, tmp_path_factory)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(4):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result:\n{done.stderr[-3000:]}"
        result = json.loads(path.read_text())
        assert result["type"] == "TorchTensorParallel" and result["mesh"] == [2, 2]
        assert result["is_tensor_parallel"]  # isinstance(tp, ka.TensorParallel)
        assert result["ok"], f"rank {rank}: {result['problems']}"


@pytest.mark.slow
def test_a_batch_and_weights_cut_over_both_mesh_axes_train_like_one_process(
    tmp_path_factory,
):
    # `torch_parity_worker.MULTI_AXIS_RULES` on 2x2: the batch and three
    # kernels cut over ("batch", "model"), DTensor Shard on both mesh dims;
    # each rank feeds its quarter of the batch and holds a quarter of them.
    done, _, out = parity_run("mlp", TENSOR_PARALLEL_MESH, tmp_path_factory)
    assert done.returncode == 0, done.stderr[-4000:]
    plan = ka.ShardingPlan.load(str(out / "mlp_multi_axis_plan.json"))
    assert plan.batch_axis == ("batch", "model")
    assert plan.variable("mlp_up/kernel").spec == (("batch", "model"), None)
    for rank in range(4):
        path = out / f"mlp_multi_axis_rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result:\n{done.stderr[-3000:]}"
        result = json.loads(path.read_text())
        assert result["ok"], f"rank {rank}: {result['problems']}"
        assert result["parameters"] == plan.bytes_per_device()
        # The three kernels (32x128, 128x32, 32x8 float32) are a quarter each.
        kernels = (32 * 128 + 128 * 32 + 32 * 8) * 4
        assert result["sharded_total"] == kernels
