"""One torchrun rank of a user's script: `TensorParallel` over a Keras model
on 2 ranks, one training step, then the script returns (no
`destroy_process_group()`, no special ending). The model stays referenced
by this module while the interpreter shuts down.

The check registered first below runs after the library's exit cleanup
(atexit runs the last registered first) and writes `rank<r>.json`:
{"running": gloo's threads after the step, "at_exit": those still alive}.

Usage: torchrun --nproc-per-node 2 tests/workers/torch_exit_worker.py OUT
"""

import atexit
import json
import os
import sys


def gloo_threads() -> list[str]:
    """Names of this process's threads that gloo's process groups started
    (`pt_gloo_runloop`, `gloo_tcp_loop`)."""
    names = []
    for thread in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{thread}/comm") as file:
                name = file.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


RUNNING: list[str] = []


def _report(out_dir: str) -> None:
    result = {"running": RUNNING, "at_exit": gloo_threads()}
    path = os.path.join(out_dir, f"rank{os.environ['RANK']}.json")
    with open(path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    atexit.register(_report, sys.argv[1])
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )

    import keras
    import numpy as np

    import keras_autoshard as ka

    keras.utils.set_random_seed(0)
    MODEL = ka.TensorParallel(
        keras.Sequential([keras.Input((16,)), keras.layers.Dense(32)]),
        world_size=2,
        distributed_backend="torch",
    )
    MODEL.compile(optimizer="adam", loss="mse")
    MODEL.train_on_batch(np.ones((4, 16), "float32"), np.ones((4, 32), "float32"))
    RUNNING.extend(gloo_threads())
