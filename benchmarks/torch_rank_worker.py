"""One rank of `benchmarks.torch_ranks`: time training steps of a KerasHub
GPT-2 sharded over torchrun ranks (or unsharded in one process with
`single`) and count the bytes its collectives move in one step.

Usage: torchrun --nproc-per-node N benchmarks/torch_rank_worker.py DxM OUT.json
       python benchmarks/torch_rank_worker.py single OUT.json
"""

import contextlib
import json
import os
import sys
import time

if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

BATCH, SEQ, WARMUP, TIMED = 8, 128, 2, 5
CONFIG = dict(
    vocabulary_size=1024,
    num_layers=2,
    num_heads=8,
    hidden_dim=256,
    intermediate_dim=1024,
    max_sequence_length=SEQ,
    dropout=0.0,
)
# DTensor calls these functional collectives for every redistribution.
COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "all_gather_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
)


def build():
    import keras_hub

    keras.utils.set_random_seed(0)
    return keras_hub.models.GPT2Backbone(**CONFIG)


def data():
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 1024, (BATCH, SEQ)).astype("int32"),
        "padding_mask": np.ones((BATCH, SEQ), "int32"),
    }
    y = rng.standard_normal((BATCH, SEQ, CONFIG["hidden_dim"])).astype("float32")
    return x, y


@contextlib.contextmanager
def counted_collectives(counts):
    """Count calls and input bytes of DTensor's functional collectives."""
    import torch.distributed._functional_collectives as funcol

    originals = {name: getattr(funcol, name) for name in COLLECTIVES}

    def counting(name, function):
        def wrapper(tensor, *args, **kwargs):
            entry = counts.setdefault(name, [0, 0])
            entry[0] += 1
            entry[1] += tensor.numel() * tensor.element_size()
            return function(tensor, *args, **kwargs)

        return wrapper

    for name, function in originals.items():
        setattr(funcol, name, counting(name, function))
    try:
        yield counts
    finally:
        for name, function in originals.items():
            setattr(funcol, name, function)


def timed_steps(model, x, y):
    for _ in range(WARMUP):
        model.train_on_batch(x, y)
    seconds = []
    for _ in range(TIMED):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def main():
    mesh_text, out_path = sys.argv[1:3]
    x, y = data()
    if mesh_text == "single":
        model = build()
        model.compile(optimizer="adam", loss="mse")
        result = {"ranks": 1, "step_s": timed_steps(model, x, y), "collectives": {}}
        with open(out_path, "w") as f:
            json.dump(result, f)
        return

    import torch.distributed as dist

    from keras_autoshard import MeshSpec
    from keras_autoshard.apply.torch.dtensor_layout import torch_device_mesh
    from keras_autoshard.apply.torch.planning import plan_for_torch
    from keras_autoshard.apply.torch.sharded_model import TorchShardedModel
    from keras_autoshard.runtime.torch_processes import ensure_process_group

    ensure_process_group()
    shape = tuple(int(s) for s in mesh_text.split("x"))
    mesh = MeshSpec(shape, ("batch", "model"))
    model = build()
    plan = plan_for_torch(model, mesh, x)
    sharded = TorchShardedModel(model, plan, torch_device_mesh(mesh))
    sharded.compile(optimizer="adam", loss="mse")
    data_ways = mesh.axis_size("batch")
    index = dist.get_rank() // mesh.axis_size("model")
    rows = slice(index * BATCH // data_ways, (index + 1) * BATCH // data_ways)
    local_x = {k: v[rows] for k, v in x.items()}
    step_s = timed_steps(sharded, local_x, y[rows])
    counts = {}
    with counted_collectives(counts):
        sharded.train_on_batch(local_x, y[rows])
    held = sharded.state_bytes()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "ranks": dist.get_world_size(),
                    "mesh": list(shape),
                    "step_s": step_s,
                    "collectives": counts,
                    "parameters": held.parameters,
                    "optimizer": held.optimizer,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
