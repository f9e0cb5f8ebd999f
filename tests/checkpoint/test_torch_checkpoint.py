"""PyTorch backend: `save_checkpoint` on a 2x2 mesh (DCP, each rank its
shards) restores on 1x2 and on one rank bit for bit, weights and optimizer
state, and training continues with the uninterrupted run's losses; the JAX
backend refuses the checkpoint, naming the conversion that works."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")

import keras_autoshard as ka  # noqa: E402
from tests.workers import torch_parity_worker as worker  # noqa: E402
from tests.workers.torch_launch import rank_results, torchrun  # noqa: E402

WORKER = "torch_checkpoint_worker.py"


def _check(done, result_dir, ranks):
    """torchrun exited 0 and every rank reported no problem."""
    results = rank_results(result_dir, ranks)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank, result in results.items():
        assert result is not None, f"rank {rank}: no result\n{done.stderr[-3000:]}"
        assert result["ok"], result["problems"]


def _run(mode, mesh_text, out_dir):
    ranks = int(np.prod([int(s) for s in mesh_text.split("x")]))
    done = torchrun(ranks, WORKER, [mode, mesh_text, str(out_dir)])
    _check(done, out_dir, ranks)
    for path in out_dir.glob("rank*.json"):
        path.unlink()


@pytest.fixture(scope="module")
def killed_2x2(tmp_path_factory):
    """One 2x2 job (4 ranks, the worker's `kill` mode): a save of step 3, the
    uninterrupted run's 5 more steps, then a save of step 8 that rank 1
    kills. Returns `(torchrun's result, its folder)`. The killed-save test
    reads how it ended; the restore and damaged-shard tests share its step 3
    (none writes into its checkpoint), so each restore is also one after a
    killed save. (One launch instead of a clean save and a killed one: each
    rank's imports alone take about 7 CPU-seconds.)"""
    out_dir = tmp_path_factory.mktemp("killed_2x2")
    done = torchrun(4, WORKER, ["kill", "2x2", str(out_dir)])
    return done, out_dir


@pytest.fixture(scope="module")
def saved_2x2(killed_2x2):
    """The folder of `killed_2x2`, once its job has ended."""
    return killed_2x2[1]


ONE_BY_TWO = ("restore", "callback", "damaged")


@pytest.fixture(scope="module")
def one_by_two(saved_2x2, tmp_path_factory):
    """The 1x2 jobs in one torchrun launch: a restore of the 2x2 save, the
    callback's saves (in a folder of their own) and restores of damaged
    copies of the 2x2 save (one file missing, one truncated). Returns
    `(torchrun's result, {job: its results folder}, the callback's folder)`."""
    step = saved_2x2 / "ckpt" / "3"
    shutil.copytree(step, saved_2x2 / "missing" / "3")
    shard_files = sorted((saved_2x2 / "missing" / "3").glob("*.distcp"))
    assert len(shard_files) == 4  # one per rank
    shard_files[1].unlink()
    shutil.copytree(step, saved_2x2 / "truncated" / "3")
    victim = sorted((saved_2x2 / "truncated" / "3").glob("*.distcp"))[2]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    callback_dir = tmp_path_factory.mktemp("callback")
    results = {job: tmp_path_factory.mktemp(f"{job}_results") for job in ONE_BY_TWO}
    data = {"restore": saved_2x2, "callback": callback_dir, "damaged": saved_2x2}
    jobs = [[job, "1x2", str(data[job]), str(results[job])] for job in ONE_BY_TWO]
    done = torchrun(2, WORKER, ["jobs", json.dumps(jobs)])
    return done, results, callback_dir


@pytest.mark.slow
def test_a_2x2_checkpoint_restores_on_1x2_and_one_rank_and_training_goes_on(
    saved_2x2, one_by_two
):
    done, results, _ = one_by_two
    _check(done, results["restore"], 2)
    _run("restore", "1x1", saved_2x2)
    expected = json.loads((saved_2x2 / "losses.json").read_text())
    for mesh_text in ("1x2", "1x1"):
        losses = json.loads(
            (saved_2x2 / f"restored_losses_{mesh_text}.json").read_text()
        )
        np.testing.assert_allclose(losses, expected, rtol=1e-6)
    # On the JAX backend (this process) the torch checkpoint is refused with
    # the conversion that works.
    model = worker.build("mlp", seed=1)
    with pytest.raises(ka.errors.CheckpointError, match="save_weights.*load_weights"):
        ka.restore_checkpoint(model, saved_2x2 / "ckpt")


@pytest.mark.slow
def test_the_callback_saves_every_n_batches_and_keeps_the_latest(one_by_two):
    done, results, callback_dir = one_by_two
    _check(done, results["callback"], 2)
    assert sorted(p.name for p in (callback_dir / "callback").iterdir()) == [
        "4",
        "6",
    ]


@pytest.mark.slow
def test_missing_or_truncated_shard_files_are_named_on_every_rank(one_by_two):
    done, results, _ = one_by_two
    _check(done, results["damaged"], 2)


@pytest.mark.slow
def test_a_rank_killed_during_save_leaves_the_previous_step_restorable(
    killed_2x2, one_by_two
):
    done, out_dir = killed_2x2
    assert done.returncode != 0  # rank 1 was SIGKILLed, the job stopped
    directory = out_dir / "ckpt"
    assert (directory / "8.partial").is_dir()  # the killed save's leftovers
    assert ka.ShardedCheckpoint.complete_steps(directory) == [3]
    # The 1x2 restore of that folder took its latest complete step, bit for
    # bit, and trained on.
    restored, results, _ = one_by_two
    _check(restored, results["restore"], 2)


def _as_if_on_torch(monkeypatch, tmp_path):
    """Make this (JAX) process take save_checkpoint's PyTorch path, with the
    DCP write replaced by a record of what it was handed."""
    from keras_autoshard.checkpoint import torch_dcp

    handed = {}
    monkeypatch.setattr(torch_dcp, "torch_backend", lambda: True)
    monkeypatch.setattr(
        torch_dcp,
        "save_checkpoint_torch",
        lambda model, directory, step, info, max_to_keep: handed.update(info),
    )
    return worker.build("mlp", seed=1), tmp_path / "ckpt", handed


@pytest.mark.parametrize("argument", [{"wait": False}, {"progress": True}])
def test_torch_save_refuses_what_it_cannot_do_naming_the_argument(
    monkeypatch, tmp_path, argument
):
    model, directory, handed = _as_if_on_torch(monkeypatch, tmp_path)
    ((name, value),) = argument.items()
    with pytest.raises(ka.errors.CheckpointError, match=f"{name}={value}"):
        ka.save_checkpoint(model, directory, step=1, **argument)
    assert handed == {}  # refused before any rank writes


def test_torch_save_stores_the_plan_it_is_given(monkeypatch, tmp_path):
    model, directory, handed = _as_if_on_torch(monkeypatch, tmp_path)
    mesh = ka.MeshSpec((1, 2), ("batch", "model"))
    rules = {"mlp_up/kernel": (None, "model")}
    plan = ka.plan_from_rules(model.variables, mesh, rules, "batch")
    ka.save_checkpoint(model, directory, step=1, plan=plan)
    assert ka.ShardingPlan.from_dict(handed["plan"]) == plan


def test_a_damaged_torch_record_is_an_error_naming_the_file(tmp_path):
    step = tmp_path / "ckpt" / "1"
    step.mkdir(parents=True)
    (step / "keras_autoshard.json").write_text("{not json")
    model = worker.build("mlp", seed=1)
    with pytest.raises(
        ka.errors.CheckpointError, match=str(step / "keras_autoshard.json")
    ):
        ka.restore_checkpoint(model, tmp_path / "ckpt")
