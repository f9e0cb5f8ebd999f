"""A process that saves checkpoints until it is killed (run by
`tests/checkpoint/test_checkpoint_kill.py`).

Usage: `python -m tests.workers.checkpoint_kill_worker DIRECTORY MODE`

It saves step 1 and prints `SAVED 1`; then, in mode `loop`, saves steps 2, 3,
... printing `SAVING k` / `SAVED k` around each; in mode `async-then-die`, it
starts an asynchronous save of step 2 and SIGKILLs itself at once. The values
of step k are `step_values(path, shape, k)`, so the killer can check a
restored checkpoint bit for bit without sharing memory with this process.
"""

import os
import signal
import sys
import zlib

if __name__ == "__main__":
    from tests import no_tensorflow

    no_tensorflow.hide()

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from keras_autoshard.runtime.devices import simulate_devices  # noqa: E402

simulate_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_autoshard import (  # noqa: E402
    MeshSpec,
    PlanDistribution,
    plan_from_rules,
    save_checkpoint,
)
from keras_autoshard.testing import zoo  # noqa: E402

HIDDEN = 512  # about 24 MiB of weights and Adam state per checkpoint
RULES = {"up/kernel": (None, "model"), "down/kernel": ("model", None)}


def build_model(distribution=None) -> keras.Model:
    """The MLP block with a built Adam, under `distribution` if given."""
    scope = distribution.scope() if distribution is not None else _Nothing()
    with scope:
        model = zoo.build_mlp_block(hidden=HIDDEN)
        model.compile(optimizer=keras.optimizers.Adam(name="adam"), loss="mse")
        model.optimizer.build(model.trainable_variables)
    return model


def make_plan(mesh: MeshSpec):
    reference = zoo.build_mlp_block(hidden=HIDDEN)
    return plan_from_rules(reference.variables, mesh, RULES, "batch")


def step_values(path: str, shape, dtype: str, step: int) -> np.ndarray:
    """The value a variable has in checkpoint `step`."""
    if "int" in dtype:
        return np.full(shape, step, dtype)
    rng = np.random.default_rng(zlib.crc32(path.encode()))
    return (rng.standard_normal(shape) + step).astype(dtype)


def set_step_values(model: keras.Model, step: int) -> None:
    for variable in model.variables + model.optimizer.variables:
        variable.assign(
            step_values(variable.path, variable.shape, variable.dtype, step)
        )


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(directory: str, mode: str) -> None:
    model = build_model(
        PlanDistribution(make_plan(MeshSpec((2, 4), ("batch", "model"))))
    )
    set_step_values(model, 1)
    save_checkpoint(model, directory, step=1)
    print("SAVED 1", flush=True)
    if mode == "async-then-die":
        set_step_values(model, 2)
        save_checkpoint(model, directory, step=2, wait=False)
        os.kill(os.getpid(), signal.SIGKILL)
    step = 2
    while True:
        set_step_values(model, step)
        print(f"SAVING {step}", flush=True)
        save_checkpoint(model, directory, step=step, max_to_keep=2)
        print(f"SAVED {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
