"""The PyTorch collectives on 2 and 4 gloo ranks (real processes on the CPU)
match the single-process computation, forward and backward.

Each rank runs every check of tests/workers/collectives_torch_worker.py and reports
per check; a launch that does not finish within `TIMEOUT_S` fails instead of
stalling the suite.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from keras_autoshard.runtime.collectives import (  # noqa: E402
    CollectiveError,
    all_gather,
    all_reduce,
    broadcast,
    copy_to_parallel,
    reduce_from_parallel,
    reduce_scatter,
    scatter,
)
from tests.workers.collectives_torch_worker import CHECKS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "collectives_torch_worker.py"
WORLD_SIZES = (2, 4)
TIMEOUT_S = 120


def launch(world_size: int, out_dir: Path) -> list[dict]:
    """Run the worker on `world_size` gloo ranks; their reports by rank."""
    env_overrides = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    logs = [open(out_dir / f"rank{rank}.log", "w") for rank in range(world_size)]
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(rank),
                str(world_size),
                str(out_dir / "rendezvous"),
                str(out_dir),
            ],
            env={**os.environ, **env_overrides},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for rank, log in enumerate(logs)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for process in ranks:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        for process in ranks:
            process.kill()
        for process in ranks:
            process.wait()
        pytest.fail(
            f"{world_size} ranks did not finish within {TIMEOUT_S} s.\n"
            + _log_tails(out_dir, world_size)
        )
    finally:
        for log in logs:
            log.close()
    reports = []
    for rank in range(world_size):
        report_file = out_dir / f"rank{rank}.json"
        if not report_file.exists():
            pytest.fail(
                f"rank {rank} of {world_size} wrote no report (exit code "
                f"{ranks[rank].returncode}).\n" + _log_tails(out_dir, world_size)
            )
        report = json.loads(report_file.read_text())
        reports.append({**report, "exit_code": ranks[rank].returncode})
    return reports


def _log_tails(out_dir: Path, world_size: int) -> str:
    return "\n".join(
        f"--- rank {rank} ---\n" + (out_dir / f"rank{rank}.log").read_text()[-2000:]
        for rank in range(world_size)
    )


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def rank_reports(request, tmp_path_factory) -> list[dict]:
    return launch(request.param, tmp_path_factory.mktemp(f"ranks{request.param}"))


def test_every_rank_ran_every_check(rank_reports):
    assert [report["rank"] for report in rank_reports] == list(range(len(rank_reports)))
    for report in rank_reports:
        assert report["checks"] == CHECKS
        # A rank ends like a user's script: normally, 0 when every check
        # passed, 1 when one failed (reported per check below), never an
        # abort at interpreter exit.
        expected = 1 if report["failures"] else 0
        assert report["exit_code"] == expected, (report["rank"], report["exit_code"])


@pytest.mark.parametrize("check", CHECKS)
def test_rank_matches_single_process(rank_reports, check):
    failures = {
        report["rank"]: report["failures"][check]
        for report in rank_reports
        if check in report["failures"]
    }
    assert not failures, "\n".join(
        f"rank {rank}: {message}" for rank, message in failures.items()
    )


PUBLIC_CALLS = {
    "all_reduce": lambda x: all_reduce(x),
    "all_gather": lambda x: all_gather(x),
    "reduce_scatter": lambda x: reduce_scatter(x),
    "broadcast": lambda x: broadcast(x),
    "scatter": lambda x: scatter(x),
    "copy_to_parallel": lambda x: copy_to_parallel(x),
    "reduce_from_parallel": lambda x: reduce_from_parallel(x),
}


@pytest.mark.parametrize("name", PUBLIC_CALLS)
def test_without_process_group_raises_and_says_how_to_start_one(name):
    assert not torch.distributed.is_initialized()
    with pytest.raises(CollectiveError) as raised:
        PUBLIC_CALLS[name](torch.ones(4, 2, requires_grad=True))
    message = str(raised.value)
    assert message.startswith(name)
    assert "init_process_group" in message and "torchrun" in message


def test_importing_collectives_imports_neither_torch_nor_jax():
    code = (
        "import sys, keras_autoshard.runtime.collectives\n"
        "loaded = {'torch', 'jax'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_non_tensor_input_raises_collective_error():
    import numpy as np

    with pytest.raises(CollectiveError, match="torch.Tensor or a JAX array"):
        all_reduce(np.ones(3))
