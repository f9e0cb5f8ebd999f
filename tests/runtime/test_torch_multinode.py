"""PyTorch backend on two torchrun "nodes" (two launches on localhost).

Two `torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2` launches meet
through a static rendezvous, as on two hosts. The workers join with
`keras_autoshard.distributed.initialize()`, train a 2x2 (batch x model) plan: data
parallel across the nodes, tensor parallel within each, every rank
generating only its rows of the global batch. See the `multinode` mode of
tests/workers/torch_parity_worker.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from tests.workers import torch_parity_worker as worker  # noqa: E402
from tests.xla_flags import child_env  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parents[1] / "workers" / "torch_parity_worker.py"
NODES, RANKS_PER_NODE = 2, 2
JOB_TIMEOUT_S = 150
STOP_TIMEOUT_S = 30


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_node(node_rank: int, port: int, name: str, out: Path) -> subprocess.Popen:
    env = child_env(KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    log = open(out / f"node{node_rank}.log", "w")  # noqa: SIM115 (closed by the OS)
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={NODES}", f"--node-rank={node_rank}",
        f"--nproc-per-node={RANKS_PER_NODE}",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        str(WORKER), name, "2x2", str(out), "multinode",
    ]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_or_stop(procs: list[subprocess.Popen]) -> list[int]:
    """Exit codes; a launch still running after the timeout is stopped (its
    agent's SIGTERM handler stops its workers too) and reported as -1."""
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=JOB_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            codes.append(-1)
    return codes


@pytest.fixture(scope="module")
def mlp_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_two_nodes_mlp")
    port = _free_port()
    codes = _wait_or_stop([_launch_node(n, port, "mlp", out) for n in range(NODES)])
    logs = "\n".join((out / f"node{n}.log").read_text()[-2000:] for n in range(NODES))
    results = {}
    for rank in range(NODES * RANKS_PER_NODE):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result (exits {codes}):\n{logs}"
        results[rank] = json.loads(path.read_text())
    assert codes == [0] * NODES, f"torchrun exits {codes}:\n{logs}"
    return results, out


def test_two_torchrun_nodes_train_like_one_process_for_5_adam_steps(mlp_job):
    results, _ = mlp_job
    for rank, result in results.items():
        assert result["ok"], f"rank {rank}: {result['problems']}"
        assert result["losses"] <= worker.RTOL
        assert result["weights_after_steps"] <= worker.RTOL
        assert len(result["loss_values"]) == worker.STEPS
        assert result["loss_values"][-1] < result["loss_values"][0]
        # The auto plan cuts weights over the model axis (not pure data parallel).
        assert result["sharded_variables"] > 0


def test_initialize_finds_the_torchrun_job_of_4_processes_on_every_rank(mlp_job):
    results, _ = mlp_job
    for rank, result in results.items():
        spec = result["spec"]
        assert spec["source"] == "torchrun"
        assert spec["num_processes"] == NODES * RANKS_PER_NODE == result["world_size"]
        assert spec["process_id"] == rank == result["rank"]
        # torch's rendezvous itself (MASTER_ADDR:MASTER_PORT).
        assert spec["coordinator_address"] == f"127.0.0.1:{result['master_port']}"
        assert result["second_initialize_same"], "initialize() twice differed"


def test_data_parallel_spans_nodes_and_each_rank_makes_only_its_rows(mlp_job):
    results, _ = mlp_job
    half = worker.BATCH // NODES
    for rank, result in results.items():
        node = rank // RANKS_PER_NODE
        assert result["node"] == node
        # Model-axis neighbours on this rank's node, batch-axis ones on both.
        assert result["nodes_along_model"] == [node] * RANKS_PER_NODE
        assert result["nodes_along_batch"] == list(range(NODES))
        assert result["rows"] == [node * half, (node + 1) * half]
        local, _ = worker.batch_rows("mlp", range(*result["rows"]))
        assert result["local_inputs_sum"] == pytest.approx(
            float(np.sum(local, dtype="float64")), rel=1e-12
        )
    sums = {result["local_inputs_sum"] for result in results.values()}
    assert len(sums) == NODES, "both nodes fed the same rows"


def test_torch_distributed_checkpoint_saves_shards_per_rank_and_restores(mlp_job):
    # keras_autoshard has no torch checkpoint of its own: this is
    # torch.distributed.checkpoint on the sharded model's DTensor state.
    results, out = mlp_job
    written = sorted(p.name for p in (out / "checkpoint").iterdir())
    ranks = NODES * RANKS_PER_NODE
    assert written == [".metadata"] + [f"__{r}_0.distcp" for r in range(ranks)]
    for rank, result in results.items():
        assert result["restored_weights_before_load"] > 0.1
        assert result["restored_weights"] <= worker.RTOL, f"rank {rank}"
        assert result["restored_next_loss"] <= worker.RTOL, f"rank {rank}"
