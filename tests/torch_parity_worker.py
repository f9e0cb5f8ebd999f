"""One torchrun rank of the PyTorch-backend parity test.

Builds the model twice with the same seed (a single-process reference and
the sharded copy), plans the sharded one with the JAX planner, and compares
forward outputs, gradients and 5 Adam steps. Writes `rank<r>.json` into the
output directory: {"ok": bool, "problems": [...], figures...}.

Usage: torchrun --nproc-per-node N tests/torch_parity_worker.py MODEL DxM OUT [kill]

With `kill`, rank 1 SIGKILLs itself at the start of the third training step
(after writing the time to `killed_at`); the other ranks are left waiting in
that step's collectives.
"""

import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from keras_autoshard import MeshSpec  # noqa: E402
from keras_autoshard.backends.torch.dtensor_layout import torch_device_mesh  # noqa: E402
from keras_autoshard.backends.torch.planning import plan_for_torch  # noqa: E402
from keras_autoshard.backends.torch.process_group import ensure_process_group  # noqa: E402
from keras_autoshard.backends.torch.sharded_model import TorchShardedModel  # noqa: E402

RTOL = 1e-5
STEPS = 5
BATCH, SEQ = 8, 16


def build(name):
    keras.utils.set_random_seed(0)
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
        "forward": relative(out, expected_out),
        "losses": relative(history.history["loss"], ref_losses),
        "mesh": list(tp.plan.mesh.shape),
    }
    problems = [
        f"{key}: relative difference {figures[key]:.3g} > {RTOL}"
        for key in ("forward", "losses")
        if not figures[key] <= RTOL
    ]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"ok": not problems, "problems": problems, **figures}, f)
    torch.distributed.destroy_process_group()


def main():
    name, mesh_text, out_dir = sys.argv[1:4]
    mode = sys.argv[4] if len(sys.argv) > 4 else "parity"
    if mode == "tensor_parallel":
        ensure_process_group()
        shape = tuple(int(s) for s in mesh_text.split("x"))
        tensor_parallel_run(MeshSpec(shape, ("batch", "model")), out_dir)
        return
    ensure_process_group()
    rank = torch.distributed.get_rank()
    mesh = MeshSpec(tuple(int(s) for s in mesh_text.split("x")), ("batch", "model"))
    x, y = batch(name)
    reference = build(name)
    model = build(name)
    plan = plan_for_torch(model, mesh, x)
    device_mesh = torch_device_mesh(mesh)
    sharded = TorchShardedModel(model, plan, device_mesh)

    data = mesh.axis_size("batch")
    index = device_mesh.get_local_rank("batch")
    rows = slice(index * BATCH // data, (index + 1) * BATCH // data)
    local = keras.tree.map_structure(lambda a: a[rows], x)
    local_y = y[rows]
    if rank == 0:
        with open(os.path.join(out_dir, "plan.json"), "w") as f:
            f.write(plan.to_json())
    if mode == "kill":
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
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"ok": not problems, "problems": problems, **figures}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
