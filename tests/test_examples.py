"""The scripts in examples/ run end to end with their small default settings."""

import os
import subprocess
import sys

import pytest

from tests.xla_flags import child_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = child_env(KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.mark.slow
def test_finetune_gemma_example_trains_under_the_plan_and_loss_falls(tmp_path):
    plan_path = tmp_path / "plan.json"
    result = run_example("finetune_gemma_plan.py", "--plan-json", str(plan_path))
    out = result.stdout
    assert "Sharding plan on mesh batch=2 x model=4" in out
    assert "token embedding sharding: P('model', None)" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("Fine-tuned 4 steps on mesh batch=2 x model=4: loss ")
    first_loss, final_loss = (float(v) for v in last.split("loss ")[1].split(" -> "))
    assert final_loss < first_loss
    assert plan_path.exists()


@pytest.mark.slow
def test_custom_subclassed_example_matches_single_device_losses():
    result = run_example("custom_subclassed_model.py")
    out = result.stdout
    assert "tiny/block_0/query/kernel [embed, heads] -> (-, model)" in out
    last = out.strip().splitlines()[-1]
    assert "Trained the subclassed model on mesh batch=2 x model=4" in last
    assert float(last.rsplit(" ", 1)[1]) < 1e-5


@pytest.mark.slow
def test_load_large_checkpoint_example_reads_one_slice_at_a_time(tmp_path):
    result = run_example(
        "load_large_checkpoint.py", "--size-mib", "16", "--dir", str(tmp_path)
    )
    out = result.stdout
    assert "dense_0/kernel sharding: P(None, 'model')" in out
    # 1024 x 1024 float32 kernels cut 8 ways: 0.5 MiB per read.
    assert "largest single read 0.50 MiB of a 16.0 MiB checkpoint" in out
    assert "Saved an Orbax checkpoint shard by shard: steps [1]" in out
    assert "loading model.weights.h5" in result.stderr
    assert os.listdir(tmp_path) == []  # temporary files removed
