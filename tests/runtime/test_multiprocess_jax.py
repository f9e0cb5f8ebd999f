"""Two JAX processes x 4 simulated CPU devices (gloo) against one process x 8.

Real `jax.distributed` jobs on localhost, launched as subprocesses by
`keras_autoshard.distributed.initialize`; see tests/workers/multiprocess_jax_worker.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.xla_flags import child_env

WORKER = Path(__file__).parents[1] / "workers" / "multiprocess_jax_worker.py"
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _launch(mode: str, out: Path, *extra: str) -> subprocess.Popen:
    env = child_env(KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed by the OS)
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(out), *extra],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _job(mode: str, directory: Path, processes: int, *extra: str) -> list[Path]:
    port = str(_free_port())
    outs = [directory / f"{mode}-{processes}-{i}.json" for i in range(processes)]
    procs = [
        _launch(
            mode,
            out,
            "--processes",
            str(processes),
            "--process-id",
            str(i),
            "--port",
            port,
            *extra,
        )
        for i, out in enumerate(outs)
    ]
    return procs, outs


def _wait(procs, outs, timeout_s=300):
    for proc, out in zip(procs, outs):
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"{out.name} did not finish in {timeout_s} s")
        log = out.with_suffix(".log").read_text()[-3000:]
        assert proc.returncode == 0, f"{out.name} exited {proc.returncode}:\n{log}"
    return [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Fit 5 steps on 2 processes (and save), on 1 process, then restore."""
    directory = tmp_path_factory.mktemp("multiprocess")
    checkpoint = directory / "checkpoint"
    two = _job("fit", directory, 2, "--checkpoint", str(checkpoint))
    one = _job("fit", directory, 1)
    two_results = _wait(*two)
    one_results = _wait(*one)
    restored = _wait(
        *_job("restore", directory, 1, "--checkpoint", str(checkpoint), "--mesh", "1x8")
    )
    return {
        "two": two_results,
        "one": one_results[0],
        "restored": restored[0],
        "checkpoint": checkpoint,
    }


def test_two_processes_train_like_one_process_with_eight_devices(runs):
    one = runs["one"]
    for result in runs["two"]:
        assert result["devices"] == 8
        assert "of 2" in result["spec"]
        np.testing.assert_allclose(result["losses"], one["losses"], rtol=1e-6)
        assert len(result["losses"]) == 5
        # The same automatic plan on every process, and the one-process plan.
        assert result["plan"] == one["plan"]
    for two_weight, one_weight in zip(runs["two"][0]["weights"], one["weights"]):
        scale = np.max(np.abs(one_weight))
        np.testing.assert_allclose(two_weight, one_weight, atol=1e-5 * scale)


def test_every_process_loads_only_its_rows_of_each_batch(runs):
    first, second = runs["two"]
    assert (first["rows"], second["rows"]) == ([0, 8], [8, 16])
    assert first["local_rows"] == second["local_rows"] == 40
    assert runs["one"]["rows"] == [0, 16] and runs["one"]["local_rows"] == 80


def test_checkpoint_saved_by_two_processes_holds_each_process_shards(runs):
    step = runs["checkpoint"] / "5" / "pytree"
    per_process = sorted(p.name for p in step.glob("ocdbt.process_*"))
    assert per_process == ["ocdbt.process_0", "ocdbt.process_1"]
    sizes = [
        sum(f.stat().st_size for f in (step / name).rglob("*") if f.is_file())
        for name in per_process
    ]
    assert all(size > 0 for size in sizes)


def test_two_process_checkpoint_restores_bit_exact_into_one_process_mesh_1x8(runs):
    restored, saved = runs["restored"], runs["two"][0]
    assert json.loads(restored["plan"])["mesh"]["shape"] == [1, 8]
    assert len(restored["weights"]) == len(saved["weights"])
    for got, want in zip(restored["weights"], saved["weights"]):
        assert np.array_equal(np.asarray(got), np.asarray(want))


def test_a_killed_process_stops_the_other_within_60_seconds(tmp_path):
    procs, outs = _job("die", tmp_path, 2)
    killed, survivor = procs[1], procs[0]
    try:
        killed.wait(timeout=240)
        died_at = time.monotonic()
        survivor.wait(timeout=90)
        stopped_after_s = time.monotonic() - died_at
    finally:
        for proc in procs:
            proc.kill()
    assert killed.returncode == -9
    assert survivor.returncode != 0
    assert stopped_after_s < 60, stopped_after_s
    log = outs[0].with_suffix(".log").read_text()
    assert "another task died" in log or "stopped sending heartbeats" in log, log[
        -2000:
    ]
