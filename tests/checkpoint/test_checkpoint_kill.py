"""A save killed part way (SIGKILL, in a real subprocess) never costs the
previous checkpoint: the latest complete step restores bit for bit."""

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_autoshard import (
    MeshSpec,
    PlanDistribution,
    restore_checkpoint,
    save_checkpoint,
)
from keras_autoshard.checkpoint.steps import complete_steps
from tests.workers import checkpoint_kill_worker as worker

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 120
TMP_MARKER = ".orbax-checkpoint-tmp"


@pytest.fixture
def tmp_path(tmp_path):
    """pytest's `tmp_path`, removed after the test (checkpoints are large)."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def start_worker(directory, mode) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.workers.checkpoint_kill_worker",
            str(directory),
            mode,
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def wait_for_line(process: subprocess.Popen, wanted: str) -> None:
    for line in process.stdout:
        if line.strip() == wanted:
            return
    raise AssertionError(f"worker exited (rc {process.wait()}) before {wanted!r}")


def step2_temporary(directory) -> str | None:
    names = [n for n in os.listdir(directory) if n.startswith(f"2{TMP_MARKER}")]
    return os.path.join(directory, names[0]) if names else None


def has_array_data(temporary: str) -> bool:
    """Whether the temporary step already holds written array chunks."""
    for root, _, names in os.walk(temporary):
        if os.path.basename(root) == "d" and names and "pytree" in root:
            return True
    return False


def kill_when(process: subprocess.Popen, condition) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert process.poll() is None, "worker finished before the kill point"
        assert time.monotonic() < deadline, "kill point never reached"
        time.sleep(0.0005)
    process.kill()
    process.wait()


def assert_latest_restores_bit_exact(directory) -> int:
    """Restore the latest complete step onto another mesh; check every value."""
    plan = worker.make_plan(MeshSpec((1, 8), ("batch", "model")))
    model = worker.build_model(PlanDistribution(plan))
    restored = restore_checkpoint(model, directory)
    for variable in model.variables + model.optimizer.variables:
        expected = worker.step_values(
            variable.path, variable.shape, variable.dtype, restored.step
        )
        assert np.array_equal(np.asarray(variable.value), expected), variable.path
    return restored.step


@pytest.mark.slow
def test_kill_at_several_points_of_a_save_keeps_previous_checkpoint(tmp_path):
    kill_points = {
        "temporary directory just created": lambda d: step2_temporary(d) is not None,
        "array chunks being written": lambda d: (
            step2_temporary(d) is not None and has_array_data(step2_temporary(d))
        ),
    }
    killed_mid_save = []
    for name, condition in kill_points.items():
        directory = tmp_path / name.replace(" ", "_")
        process = start_worker(directory, "loop")
        wait_for_line(process, "SAVED 1")
        kill_when(process, lambda d=str(directory), c=condition: c(d))
        if step2_temporary(str(directory)) is not None:
            killed_mid_save.append(name)
        assert complete_steps(directory) == [1], name
        assert assert_latest_restores_bit_exact(directory) == 1

    # Some kill left a half-written step behind, and it was skipped.
    assert killed_mid_save

    directory = tmp_path / "async"
    process = start_worker(directory, "async-then-die")
    process.wait(timeout=TIMEOUT_S)
    assert process.returncode == -9
    assert complete_steps(directory) == [1]
    assert assert_latest_restores_bit_exact(directory) == 1


@pytest.mark.slow
def test_kill_during_repeated_saves_leaves_latest_complete_step_loadable(tmp_path):
    directory = tmp_path / "loop"
    process = start_worker(directory, "loop")
    wait_for_line(process, "SAVED 1")
    wait_for_line(process, "SAVING 3")
    time.sleep(0.05)
    process.kill()
    process.wait()

    steps = complete_steps(directory)
    assert steps and steps[-1] >= 2
    latest = assert_latest_restores_bit_exact(directory)
    assert latest == steps[-1]

    # A new save into the same directory works after the crash.
    plan = worker.make_plan(MeshSpec((2, 4), ("batch", "model")))
    model = worker.build_model(PlanDistribution(plan))
    worker.set_step_values(model, latest + 10)
    save_checkpoint(model, directory, step=latest + 10)
    assert assert_latest_restores_bit_exact(directory) == latest + 10
