"""Launch a test worker under torchrun (gloo on CPU) and read its results."""

import json
import os
import socket
import subprocess
import sys

from tests.xla_flags import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(ranks: int, worker: str, args: list[str]) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node ranks worker *args`
    with the torch backend and no simulated JAX devices."""
    env = child_env(KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={ranks}", f"--master-port={free_port()}",
        os.path.join(ROOT, "tests", "workers", worker), *args,
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S
    )


def rank_results(out_dir, ranks: int) -> dict[int, dict | None]:
    """`rank<r>.json` of every rank (None where a rank wrote none)."""
    results = {}
    for rank in range(ranks):
        path = os.path.join(out_dir, f"rank{rank}.json")
        results[rank] = json.load(open(path)) if os.path.exists(path) else None
    return results


def finish_rank(out_dir, rank: int, result: dict) -> None:
    """Write `rank<r>.json` and return.

    The rank then ends as a user's script does: its script returns and the
    interpreter exits, running `atexit` hooks, the library's process-group
    cleanup among them. The tests check that torchrun exits 0, so a rank
    that aborts at interpreter exit fails them.

    Args:
        out_dir: The folder the test reads results from.
        rank: This process's rank.
        result: What the rank reports (JSON-serialisable).
    """
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
