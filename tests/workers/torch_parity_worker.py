"""One torchrun rank of the PyTorch-backend parity test.

Builds the model twice with the same seed (a single-process reference and
the sharded copy), plans the sharded one with the JAX planner, and compares
forward outputs, gradients and 5 Adam steps. Writes `rank<r>.json` into the
output directory: {"ok": bool, "problems": [...], figures...}.

Usage: torchrun --nproc-per-node N tests/workers/torch_parity_worker.py MODEL DxM OUT
    [MODE]

With `kill`, rank 1 SIGKILLs itself at the start of the third training step
(after writing the time to `killed_at`); the other ranks are left waiting in
that step's collectives.

With `multinode` (torchrun `--nnodes 2`), the job joins through
`keras_autoshard.distributed.initialize()`, each rank generates only its own rows of the
global batch, and 5 Adam steps are compared with one process; the state is
then saved with torch.distributed.checkpoint and loaded into a differently
initialised sharded copy, which takes a sixth step. The result also records
the cluster spec and which node each mesh neighbour runs on.
"""

import dataclasses
import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    from tests import no_tensorflow

    no_tensorflow.hide()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from keras_autoshard import MeshSpec  # noqa: E402
from keras_autoshard.apply.torch.dtensor_layout import torch_device_mesh  # noqa: E402
from keras_autoshard.apply.torch.planning import plan_for_torch  # noqa: E402
from keras_autoshard.apply.torch.sharded_model import TorchShardedModel  # noqa: E402
from keras_autoshard.planner.subprocess_planning import align_plan  # noqa: E402
from keras_autoshard.plans.rules import plan_from_rules  # noqa: E402
from keras_autoshard.runtime.torch_processes import (  # noqa: E402
    ensure_process_group,
    local_batch_rows,
)
from tests.workers.torch_launch import finish_rank  # noqa: E402

RTOL = 1e-5
STEPS = 5
BATCH, SEQ = 8, 16


def build(name, seed=0):
    keras.utils.set_random_seed(seed)
    if name == "mlp":
        inputs = keras.Input((SEQ, 32), name="features")
        h = keras.layers.Dense(128, activation="gelu", name="mlp_up")(inputs)
        h = keras.layers.Dense(32, name="mlp_down")(h)
        return keras.Model(inputs, keras.layers.Dense(8, name="head")(h))
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=256,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        intermediate_dim=256,
        max_sequence_length=SEQ,
        dropout=0.0,
    )


def batch(name):
    rng = np.random.default_rng(0)
    if name == "mlp":
        x = rng.standard_normal((BATCH, SEQ, 32)).astype("float32")
        out = 8
    else:
        x = {
            "token_ids": rng.integers(0, 256, (BATCH, SEQ)).astype("int32"),
            "padding_mask": np.ones((BATCH, SEQ), "int32"),
        }
        out = 64
    y = rng.standard_normal((BATCH, SEQ, out)).astype("float32")
    return x, y


def batch_rows(name, rows):
    """Rows `rows` of the global batch, each generated from its own index, so a
    rank makes only its own part and one process makes all of them."""
    xs, ys = [], []
    for row in rows:
        rng = np.random.default_rng([0, row])
        if name == "mlp":
            xs.append(rng.standard_normal((SEQ, 32)).astype("float32"))
            out = 8
        else:
            xs.append(rng.integers(0, 256, (SEQ,)).astype("int32"))
            out = 64
        ys.append(rng.standard_normal((SEQ, out)).astype("float32"))
    x, y = np.stack(xs), np.stack(ys)
    if name != "mlp":
        x = {"token_ids": x, "padding_mask": np.ones_like(x)}
    return x, y


def relative(a, b, scale_floor=0.0):
    """max |a - b| / max(max |b|, scale_floor), as in tests/parity.py."""
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), scale_floor, 1e-30))


def adam():
    # epsilon 1e-6 as in tests/parity.py: Adam's g / (|g| + eps) would turn
    # reduction-order rounding in near-zero gradients into large differences.
    return keras.optimizers.Adam(1e-3, epsilon=1e-6)


def plain(value):
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    return keras.ops.convert_to_numpy(value)


def gradients(model, call, x, y):
    model.zero_grad()
    loss = torch.mean((call(x) - torch.as_tensor(y)) ** 2)
    loss.backward()
    out = {}
    for v in model.trainable_variables:
        grad = v.value.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        out[v.path] = grad.detach().numpy().copy()
    return out


class KillAtThirdStep(keras.callbacks.Callback):
    def __init__(self, out_dir):
        super().__init__()
        self.out_dir = out_dir
        self.steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.steps += 1
        if self.steps == 3:
            with open(os.path.join(self.out_dir, "killed_at"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


def train_until_killed(sharded, local, local_y, rank, out_dir):
    sharded.compile(optimizer=adam(), loss="mse")
    callbacks = [KillAtThirdStep(out_dir)] if rank == 1 else []
    sharded.fit(
        local,
        local_y,
        batch_size=len(local_y),
        epochs=5,
        callbacks=callbacks,
        verbose=0,
    )


def seed_sequential():
    """The seed README's first example, smaller (784 → 1024 → 10 scaled)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def tensor_parallel_run(mesh, out_dir):
    """`TensorParallel(model, world_size, distributed_backend="torch")`."""
    import keras_autoshard as ka

    rank = torch.distributed.get_rank()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 64)).astype("float32")
    y = rng.integers(0, 10, (BATCH,)).astype("int32")
    reference = seed_sequential()
    reference.compile(optimizer=adam(), loss="sparse_categorical_crossentropy")
    expected_out = keras.ops.convert_to_numpy(reference(x))
    ref_losses = [float(reference.train_on_batch(x, y)) for _ in range(STEPS)]

    model_ways = mesh.axis_size("model")
    tp = ka.TensorParallel(
        seed_sequential(), world_size=model_ways, distributed_backend="torch"
    )
    data = mesh.axis_size("batch")
    index = rank // model_ways
    rows = slice(index * BATCH // data, (index + 1) * BATCH // data)
    out = tp.predict(x[rows], batch_size=BATCH // data, verbose=0)
    tp.compile(optimizer=adam(), loss="sparse_categorical_crossentropy")
    history = tp.fit(
        x[rows],
        y[rows],
        batch_size=BATCH // data,
        epochs=STEPS,
        verbose=0,
        shuffle=False,
    )
    figures = {
        "type": type(tp).__name__,
        "is_tensor_parallel": isinstance(tp, ka.TensorParallel),
        "forward": relative(out, expected_out),
        "losses": relative(history.history["loss"], ref_losses),
        "mesh": list(tp.plan.mesh.shape),
    }
    problems = [
        f"{key}: relative difference {figures[key]:.3g} > {RTOL}"
        for key in ("forward", "losses")
        if not figures[key] <= RTOL
    ]
    finish_rank(out_dir, rank, {"ok": not problems, "problems": problems, **figures})


def torch_state(sharded):
    """Every model and optimizer variable's (DTensor) value, keyed by position."""
    model_values = {
        f"model/{i}": v.value for i, v in enumerate(sharded.inner.variables)
    }
    optimizer_values = {
        f"optimizer/{i}": v.value for i, v in enumerate(sharded.optimizer.variables)
    }
    return {**model_values, **optimizer_values}


def restore_from_torch_checkpoint(sharded, name, device_mesh, directory):
    """Save `sharded` with torch.distributed.checkpoint (each rank writes its
    own shards), load it into a differently initialised sharded copy.

    Returns the copy and the relative difference of its weights from the
    saved ones before loading (large, so a load that did nothing shows)."""
    import torch.distributed.checkpoint as dcp

    from keras_autoshard.apply.torch.sharded_state import shard_optimizer_variables

    dcp.save(torch_state(sharded), checkpoint_id=directory)
    fresh = build(name, seed=1)
    paths = [v.path for v in sharded.inner.variables]
    plan = align_plan(sharded.plan, paths, fresh)
    restored = TorchShardedModel(fresh, plan, device_mesh)
    restored.compile(optimizer=adam(), loss="mse")
    shard_optimizer_variables(restored)
    pairs = zip(fresh.trainable_variables, sharded.inner.trainable_variables)
    before = max(relative(plain(v.value), plain(s.value)) for v, s in pairs)
    with torch.no_grad():
        dcp.load(torch_state(restored), checkpoint_id=directory)
    return restored, before


def multinode_run(name, mesh_text, out_dir):
    """Two torchrun nodes: `initialize()`, own rows per rank, 5 Adam steps."""
    import keras_autoshard as ka

    spec = ka.distributed.initialize()
    again = ka.distributed.initialize()
    ensure_process_group()
    rank = torch.distributed.get_rank()
    mesh = MeshSpec(tuple(int(s) for s in mesh_text.split("x")), ("batch", "model"))
    reference = build(name)
    model = build(name)
    x, y = batch_rows(name, range(BATCH))
    plan = plan_for_torch(model, mesh, x)
    device_mesh = torch_device_mesh(mesh)
    sharded = TorchShardedModel(model, plan, device_mesh)

    row_slice = ka.distributed.process_batch_rows(BATCH, sharded)
    rows = range(row_slice.start, row_slice.stop)
    local, local_y = batch_rows(name, rows)

    reference.compile(optimizer=adam(), loss="mse")
    sharded.compile(optimizer=adam(), loss="mse")
    ref_losses = [float(reference.train_on_batch(x, y)) for _ in range(STEPS)]
    losses = [float(sharded.train_on_batch(local, local_y)) for _ in range(STEPS)]
    pairs = list(zip(model.trainable_variables, reference.trainable_variables))
    weight_scale = max(float(np.max(np.abs(plain(r.value)))) for _, r in pairs)
    figures = {
        "losses": relative(losses, ref_losses),
        "weights_after_steps": max(
            relative(plain(v.value), plain(r.value), weight_scale) for v, r in pairs
        ),
    }

    restored, before_load = restore_from_torch_checkpoint(
        sharded, name, device_mesh, os.path.join(out_dir, "checkpoint")
    )
    restored_loss = float(restored.train_on_batch(local, local_y))
    figures["restored_next_loss"] = relative(
        restored_loss, float(reference.train_on_batch(x, y))
    )
    figures["restored_weights"] = max(
        relative(plain(v.value), plain(r.value), weight_scale)
        for v, r in zip(
            restored.inner.trainable_variables, reference.trainable_variables
        )
    )
    problems = [
        f"{key}: relative difference {value:.3g} > {RTOL}"
        for key, value in figures.items()
        if not value <= RTOL
    ]

    def nodes_along(axis):
        nodes = [None] * mesh.axis_size(axis)
        node = int(os.environ["GROUP_RANK"])
        torch.distributed.all_gather_object(
            nodes, node, group=device_mesh.get_group(axis)
        )
        return nodes

    result = {
        "ok": not problems,
        "problems": problems,
        **figures,
        "restored_weights_before_load": before_load,
        "loss_values": losses,
        "reference_losses": ref_losses,
        "spec": dataclasses.asdict(spec),
        "master_port": os.environ["MASTER_PORT"],
        "second_initialize_same": again == spec,
        "rank": rank,
        "world_size": torch.distributed.get_world_size(),
        "node": int(os.environ["GROUP_RANK"]),
        "rows": [rows.start, rows.stop],
        "local_inputs_sum": sum(
            float(np.sum(part, dtype="float64")) for part in keras.tree.flatten(local)
        ),
        "nodes_along_batch": nodes_along("batch"),
        "nodes_along_model": nodes_along("model"),
        "sharded_variables": sum(
            any(axis is not None for axis in v.spec) for v in plan.variables
        ),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


def main():
    name, mesh_text, out_dir = sys.argv[1:4]
    mode = sys.argv[4] if len(sys.argv) > 4 else "parity"
    if mode == "multinode":
        multinode_run(name, mesh_text, out_dir)
        return
    if mode == "tensor_parallel":
        ensure_process_group()
        shape = tuple(int(s) for s in mesh_text.split("x"))
        tensor_parallel_run(MeshSpec(shape, ("batch", "model")), out_dir)
        return
    ensure_process_group()
    mesh = MeshSpec(tuple(int(s) for s in mesh_text.split("x")), ("batch", "model"))
    if mode == "kill":
        parity_case(name, mesh, out_dir, kill=True)
        return
    # One launch checks every model named (comma-separated) on this mesh:
    # each writes <name>_rank<rank>.json and <name>_plan.json. Mode
    # `parity,tensor_parallel` then runs `tensor_parallel_run` in the same
    # launch (rank<rank>.json).
    # `multi_axis` then checks the mlp under `MULTI_AXIS_RULES`.
    modes = mode.split(",")
    for one in name.split(","):
        parity_case(one, mesh, out_dir)
    if "multi_axis" in modes:
        parity_case("mlp", mesh, out_dir, rules=MULTI_AXIS_RULES)
    if "tensor_parallel" in modes:
        tensor_parallel_run(mesh, out_dir)
    torch.distributed.destroy_process_group()


# A hand-written plan whose batch and weights are cut over both mesh axes at
# once (DTensor `Shard` on both mesh dims): FSDP-style storage over every rank.
MULTI_AXIS_BATCH = ("batch", "model")
MULTI_AXIS_RULES = {
    "mlp_up/kernel": (MULTI_AXIS_BATCH, None),
    "mlp_down/kernel": (None, MULTI_AXIS_BATCH),
    "head/kernel": (MULTI_AXIS_BATCH, None),
}


def parity_case(name, mesh, out_dir, kill=False, rules=None):
    """Plan `name` for the torch ranks (or apply `rules`, a hand-written plan
    with the batch over `MULTI_AXIS_BATCH`), then compare its forward pass,
    gradients and 5 Adam steps with one process; write this rank's figures
    (`<name>_rank<r>.json`, `<name>_multi_axis_rank<r>.json` for rules)."""
    rank = torch.distributed.get_rank()
    x, y = batch(name)
    reference = build(name)
    model = build(name)
    if rules is None:
        plan = plan_for_torch(model, mesh, x)
    else:
        plan = plan_from_rules(model.variables, mesh, rules, MULTI_AXIS_BATCH)
        name_as = f"{name}_multi_axis"
    device_mesh = torch_device_mesh(mesh)
    sharded = TorchShardedModel(model, plan, device_mesh)

    rows = local_batch_rows(BATCH, mesh, plan.batch_axis)
    local = keras.tree.map_structure(lambda a: a[rows], x)
    local_y = y[rows]
    if rules is not None:
        name = name_as
    if rank == 0:
        with open(os.path.join(out_dir, f"{name}_plan.json"), "w") as f:
            f.write(plan.to_json())
    if kill:
        train_until_killed(sharded, local, local_y, rank, out_dir)
        return

    problems, figures = [], {}
    expected = keras.ops.convert_to_numpy(reference(x))
    got = keras.ops.convert_to_numpy(sharded(local))
    figures["forward"] = relative(got, expected)

    ref_grads = gradients(reference, reference, x, y)
    got_grads = gradients(model, sharded, local, y)
    floor = 1e-3 * max(float(np.max(np.abs(g))) for g in ref_grads.values())
    figures["gradient"] = max(
        relative(got_grads[path], ref_grads[path], floor) for path in ref_grads
    )

    reference.compile(optimizer=adam(), loss="mse")
    sharded.compile(optimizer=adam(), loss="mse")
    ref_losses = [float(reference.train_on_batch(x, y)) for _ in range(STEPS)]
    losses = [float(sharded.train_on_batch(local, local_y)) for _ in range(STEPS)]
    figures["losses"] = relative(losses, ref_losses)
    pairs = list(zip(model.trainable_variables, reference.trainable_variables))
    weight_scale = max(float(np.max(np.abs(plain(r.value)))) for _, r in pairs)
    figures["weights_after_steps"] = max(
        relative(plain(v.value), plain(r.value), weight_scale) for v, r in pairs
    )
    for key in ("forward", "gradient", "losses", "weights_after_steps"):
        if not figures[key] <= RTOL:
            problems.append(f"{key}: relative difference {figures[key]:.3g} > {RTOL}")

    held = sharded.state_bytes()
    model_ways = mesh.axis_size("model")
    expected_params = (
        held.sharded_parameters_total // model_ways + held.replicated_parameters_total
        if rules is None
        else plan.bytes_per_device()  # cut over every rank
    )
    figures.update(
        parameters=held.parameters,
        optimizer=held.optimizer,
        expected_parameters=expected_params,
        sharded_total=held.sharded_parameters_total,
    )
    if held.parameters != expected_params:
        problems.append(
            f"rank holds {held.parameters} parameter bytes, expected {expected_params}"
        )
    with open(os.path.join(out_dir, f"{name}_rank{rank}.json"), "w") as f:
        json.dump({"ok": not problems, "problems": problems, **figures}, f)


if __name__ == "__main__":
    main()
