"""PyTorch backend: a user's torchrun script that trains a `TensorParallel`
model and just returns exits 0, gloo's threads ended by the library's exit
cleanup before the interpreter shuts down (left running, one of them can
abort the finished rank: "terminate called without an active exception")."""

import pytest

pytest.importorskip("torch")

from tests.workers.torch_launch import rank_results, torchrun  # noqa: E402


@pytest.mark.slow
def test_a_rank_that_returns_ends_its_gloo_threads_and_exits_0(tmp_path):
    done = torchrun(2, "torch_exit_worker.py", [str(tmp_path)])
    assert done.returncode == 0, done.stderr[-4000:]
    for rank, result in rank_results(tmp_path, 2).items():
        assert result is not None, f"rank {rank}: no result\n{done.stderr[-3000:]}"
        assert result["running"], "no gloo thread found while the group ran"
        assert result["at_exit"] == [], f"rank {rank}: {result['at_exit']} left"
