"""One torchrun rank of the PyTorch-backend checkpoint test.

Modes:

- `kill`: `TensorParallel` on mesh DxM trains 3 Adam steps, saves step 3
  with `keras_autoshard.save_checkpoint` (metadata and data-iterator state
  included), then trains 5 more steps (the uninterrupted run); rank 0
  writes `state3.npz` (every model and optimizer variable, gathered) and
  `losses.json`. Then it saves step 8, during which rank 1 SIGKILLs itself
  as soon as a shard file appears in the step's temporary directory
  (torchrun then stops the other ranks): step 3 must stay the latest
  complete one.
- `callback`: `fit` over 6 batches with `ShardedTorchCheckpoint(save_freq=2,
  max_to_keep=2)`: steps 4 and 6 remain, complete; a fresh wrapper restores
  step 6 bit for bit (weights, optimizer) with its metadata.
- `damaged`: restoring `OUT/missing` (a rank's shard file deleted) and
  `OUT/truncated` (one cut short) raises `CheckpointError` naming the file and
  a variable on every rank, weights untouched; so does restoring the MLP
  checkpoint `OUT/ckpt` into GPT-2 ("another model").
- `restore`: a differently initialised `TensorParallel` on mesh DxM restores
  the latest step and compares every variable with `state3.npz` bit for bit,
  then trains 5 steps; rank 0 writes `restored_losses.json`.

Writes `rank<r>.json`: {"ok": bool, "problems": [...]}.

Usage: torchrun --nproc-per-node N tests/workers/torch_checkpoint_worker.py MODE DxM OUT
"""

import json
import os
import signal
import sys
import threading
import time
import traceback

if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )

import numpy as np  # noqa: E402
import torch  # noqa: E402

import keras_autoshard as ka  # noqa: E402
from keras_autoshard.io.torch.dtensor_shards import full_numpy  # noqa: E402
from tests.workers.torch_launch import finish_rank  # noqa: E402
from tests.workers.torch_parity_worker import adam, batch, build  # noqa: E402
from tests.workers.torch_weights_worker import rows_of_rank  # noqa: E402

SAVED_STEP = 3
MORE_STEPS = 5
KILLED_STEP = SAVED_STEP + MORE_STEPS


def wrapped(mesh, seed):
    return ka.TensorParallel(
        build("mlp", seed=seed),
        world_size=mesh.axis_size("model"),
        distributed_backend="torch",
    )


def state(tp) -> dict[str, np.ndarray]:
    out = {f"model/{v.path}": full_numpy(v.value) for v in tp.wrapped_model.variables}
    for index, v in enumerate(tp.optimizer.variables):
        out[f"optimizer/{index}"] = full_numpy(v.value)
    return out


def train_and_save(mesh, x, y, directory):
    """A wrapper trained SAVED_STEP steps and checkpointed at that step;
    returns it and its gathered state."""
    tp = wrapped(mesh, seed=0)
    tp.compile(optimizer=adam(), loss="mse")
    for _ in range(SAVED_STEP):
        tp.train_on_batch(x, y)
    ka.save_checkpoint(
        tp,
        directory,
        step=SAVED_STEP,
        metadata={"epoch": 1},
        data_iterator_state={"position": SAVED_STEP},
    )
    return tp, state(tp)


def run(mode: str, mesh_text: str, out_dir: str) -> dict:
    mesh = ka.MeshSpec(tuple(int(s) for s in mesh_text.split("x")), ("batch", "model"))
    x, y = batch("mlp")
    rows = rows_of_rank(int(os.environ["RANK"]), mesh)
    directory = os.path.join(out_dir, "ckpt")
    problems = []
    if mode == "callback":
        return run_callback(mesh, x[rows], y[rows], out_dir)
    if mode == "damaged":
        return run_damaged(mesh, x[rows], out_dir)
    if mode == "kill":
        tp, saved = train_and_save(mesh, x[rows], y[rows], directory)
        rank = torch.distributed.get_rank()
        losses = [float(tp.train_on_batch(x[rows], y[rows])) for _ in range(MORE_STEPS)]
        # Written before this rank joins the save below, so before rank 1
        # can see a shard file of it and kill the job.
        if rank == 0:
            np.savez(os.path.join(out_dir, "state3.npz"), **saved)
            with open(os.path.join(out_dir, "losses.json"), "w") as f:
                json.dump(losses, f)
        if rank == 1:
            partial = os.path.join(directory, f"{KILLED_STEP}.partial")
            threading.Thread(
                target=_kill_on_first_shard, args=(partial,), daemon=True
            ).start()
        ka.save_checkpoint(tp, directory, step=KILLED_STEP)
        problems.append(f"rank {rank} finished a save it should not have")
    else:
        tp = wrapped(mesh, seed=5)
        rank = torch.distributed.get_rank()
        tp.compile(optimizer=adam(), loss="mse")
        tp.prepare(x[rows])
        restored = ka.restore_checkpoint(tp, directory)
        if restored.step != SAVED_STEP or restored.metadata != {"epoch": 1}:
            problems.append(f"restored {restored.step} {restored.metadata}")
        if restored.data_iterator_state != {"position": SAVED_STEP}:
            problems.append(f"iterator state {restored.data_iterator_state}")
        if restored.plan is None:
            problems.append("no plan stored")
        expected = np.load(os.path.join(out_dir, "state3.npz"))
        now = state(tp)
        if sorted(now) != sorted(expected.files):
            problems.append(f"names {sorted(now)} != {sorted(expected.files)}")
        for name in expected.files:
            if name in now and not np.array_equal(now[name], expected[name]):
                problems.append(f"{name} differs after restore")
        losses = [float(tp.train_on_batch(x[rows], y[rows])) for _ in range(MORE_STEPS)]
        if rank == 0:
            with open(
                os.path.join(out_dir, f"restored_losses_{mesh_text}.json"), "w"
            ) as f:
                json.dump(losses, f)
    return {"ok": not problems, "problems": problems}


def run_callback(mesh, x, y, out_dir) -> dict:
    directory = os.path.join(out_dir, "callback")
    tp = wrapped(mesh, seed=0)
    tp.compile(optimizer=adam(), loss="mse")
    callback = ka.ShardedCheckpoint(
        directory, save_freq=2, max_to_keep=2, metadata=lambda step: {"at": step}
    )
    repeats = 6
    tp.fit(
        np.concatenate([x] * repeats),
        np.concatenate([y] * repeats),
        batch_size=len(x),
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[callback],
    )
    problems = []
    steps = ka.ShardedCheckpoint.complete_steps(directory)
    if steps != [4, 6]:
        problems.append(f"complete steps {steps}, not [4, 6]")
    trained = state(tp)
    fresh = wrapped(mesh, seed=5)
    fresh.compile(optimizer=adam(), loss="mse")
    fresh.prepare(x)
    restored = ka.restore_checkpoint(fresh, directory)
    if restored.step != 6 or restored.metadata != {"at": 6}:
        problems.append(f"restored step {restored.step}, metadata {restored.metadata}")
    now = state(fresh)
    problems += [f"{n} differs after restore" for n in trained
                 if not np.array_equal(now[n], trained[n])]  # fmt: skip
    return {"ok": not problems, "problems": problems}


def run_damaged(mesh, x, out_dir) -> dict:
    problems = []
    tp = wrapped(mesh, seed=5)
    tp.compile(optimizer=adam(), loss="mse")
    tp.prepare(x)
    before = state(tp)
    for name in ("missing", "truncated"):
        directory = os.path.join(out_dir, name)
        try:
            ka.restore_checkpoint(tp, directory)
            problems.append(f"restoring {name} raised nothing")
        except ka.errors.CheckpointError as error:
            text = str(error)
            if ".distcp" not in text or not ("model/" in text or "optimizer/" in text):
                problems.append(f"{name}: no file or variable named: {text}")
    after = state(tp)
    problems += [
        f"{n} changed" for n in before if not np.array_equal(before[n], after[n])
    ]
    other = ka.TensorParallel(
        build("gpt2"), world_size=mesh.axis_size("model"), distributed_backend="torch"
    )
    other.compile(optimizer=adam(), loss="mse")
    other.prepare(batch("gpt2")[0])
    try:
        ka.restore_checkpoint(other, os.path.join(out_dir, "ckpt"))
        problems.append("another model's checkpoint raised nothing")
    except ka.errors.CheckpointError as error:
        if "another model" not in str(error):
            problems.append(f"unclear error for another model: {error}")
    return {"ok": not problems, "problems": problems}


def _kill_on_first_shard(partial: str) -> None:
    while True:
        if os.path.isdir(partial) and any(
            name.endswith(".distcp") for name in os.listdir(partial)
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.0005)


def run_job(mode: str, mesh_text: str, out_dir: str, result_dir: str) -> None:
    """One job on `out_dir`'s checkpoints; its figures into `result_dir`."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run(mode, mesh_text, out_dir)
    except Exception:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "problems": [traceback.format_exc()]}
    finish_rank(result_dir, rank, result)


if __name__ == "__main__":
    # `jobs '<JSON list of [mode, mesh, out_dir, result_dir]>'`: several jobs
    # of one world size in one launch (imports and process group paid once).
    if sys.argv[1] == "jobs":
        for job in json.loads(sys.argv[2]):
            run_job(*job)
    else:
        mode, mesh_text, out_dir = sys.argv[1:4]
        run_job(mode, mesh_text, out_dir, out_dir)
