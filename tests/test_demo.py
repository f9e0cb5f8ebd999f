"""The Quickstart demo runs end to end and its sharded losses match."""

import subprocess
import sys

from tests.xla_flags import child_env


def test_demo_trains_sharded_gpt2_and_losses_match_single_device():
    env = child_env(KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-m", "keras_autoshard", "demo", "--steps", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "Sharding plan on mesh batch=2 x model=4" in out
    assert "heads (dim 1) on 'model'" in out
    assert "train_step: collectives in the optimized HLO" in out
    assert "Losses match" in out


def test_demo_rejects_a_malformed_mesh_with_a_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "keras_autoshard", "demo", "--mesh", "2by4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "mesh must look like 2x4" in result.stderr
