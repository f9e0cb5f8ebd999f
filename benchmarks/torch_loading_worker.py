"""One torchrun rank of `benchmarks.torch_loading`: build the model sharded and
load its weights file, measuring this process's resident memory.

Modes:
- `abstract`: `TensorParallel(builder, weights=FILE)`: built shapes-only,
  each rank allocates and reads its shards only.
- `full`: the model built whole on every rank (what a Keras user writes),
  wrapped, then `load_weights(FILE)`.

The kernel's peak-RSS counter is reset after the imports
(`/proc/self/clear_refs`); the rank writes `rank<r>.json` with the resident
memory before, the peak during building and loading, the bytes of its
shards, and whether they equal the file's blocks.

Usage: torchrun --nproc-per-node 4 benchmarks/torch_loading_worker.py MODE FILE \
    LAYERS OUT
"""

import json
import os
import sys
import time

if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import keras_autoshard as ka  # noqa: E402
from benchmarks.checkpoint_loading import (  # noqa: E402
    WIDTH,
    _build_model,
    _reset_peak_rss,
    _rss_bytes,
)
from keras_autoshard.io.keras_weights_layout import keras_h5_keys  # noqa: E402
from keras_autoshard.io.torch.dtensor_shards import is_dtensor, local_slice_index  # noqa: E402

ROWS = 8


def warm_up_imports() -> None:
    """Import what building imports on first use: Keras's serialisation
    (used to send the model to the planner) imports TensorFlow when it is
    installed, about 460 MiB of resident memory that has nothing to do with
    the model (a KerasHub user has imported it already)."""
    import keras

    tiny = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    keras.saving.serialize_keras_object(tiny)


def measure(mode: str, path: str, layers: int) -> dict:
    x = np.ones((ROWS, WIDTH), "float32")
    warm_up_imports()
    rss_before = _rss_bytes("VmRSS")
    _reset_peak_rss()
    start = time.perf_counter()
    if mode == "abstract":
        tp = ka.TensorParallel(
            lambda: _build_model(layers),
            distributed_backend="torch",
            weights=path,
            sample_input=x,
        )
    else:
        tp = ka.TensorParallel(
            _build_model(layers), distributed_backend="torch", sample_input=x
        )
        tp.load_weights(path)
    seconds = time.perf_counter() - start
    peak = _rss_bytes("VmHWM")
    return {
        "mode": mode,
        "rank": torch.distributed.get_rank(),
        "ranks": torch.distributed.get_world_size(),
        "seconds": seconds,
        "rss_before": rss_before,
        "peak": peak,
        "rss_after": _rss_bytes("VmRSS"),
        "shard_bytes": tp.state_bytes().parameters,
        "model_bytes": sum(
            int(np.prod(v.shape)) * 4 for v in tp.wrapped_model.variables
        ),
        "file_bytes": os.path.getsize(path),
        "blocks_match_file": _blocks_match(tp.wrapped_model, path),
    }


def _blocks_match(model, path: str) -> bool:
    """Whether every local block equals the file's (the load is real)."""
    with h5py.File(path, "r") as weights:
        for key, variable in keras_h5_keys(model).items():
            value = variable.value
            index = (
                local_slice_index(value)
                if is_dtensor(value)
                else tuple(slice(0, s) for s in value.shape)
            )
            local = value.to_local() if is_dtensor(value) else value
            if not np.array_equal(local.detach().cpu().numpy(), weights[key][index]):
                return False
    return True


if __name__ == "__main__":
    mode, path, layers, out_dir = sys.argv[1:5]
    result = measure(mode, path, int(layers))
    with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as file:
        json.dump(result, file)
    torch.distributed.destroy_process_group()
