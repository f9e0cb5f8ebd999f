"""Host memory of loading a 2 GB KerasHub preset onto 8 devices.

Run from the repository root:

```
python -m benchmarks.preset_loading [--output BENCHMARKS.md]
```

One subprocess builds a GPT-2-shaped `GPT2CausalLM` of about 2 GB of float32
weights (vocabulary 50,304, 8 layers, hidden 2,048, MLP 8,192) and writes it
as a local preset (`save_to_preset`: config, task config, weights). Then, for
each loader, a fresh subprocess resets its peak-RSS counter, loads the preset
under an `AutoShardDistribution` over a 1 x 8 simulated mesh, and reports the
peak resident memory above the resident size after the load (the transient
host memory) against the largest slice a device holds:

- `keras_from_preset`: `GPT2CausalLM.from_preset(dir)` inside the
  distribution's scope (variables are created sharded, but Keras reads each
  weight whole before placing it);
- `keras_autoshard.from_preset`: the same task built under the distribution
  with no weights read, then the backbone read slice by slice.

Temporary files are removed. Without `--output` the table is printed only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Sequence

from benchmarks.checkpoint_loading import (
    _reset_peak_rss,
    _rss_bytes,
    _settle_memory,
    _setup_jax,
    run_child,
)
from keras_autoshard.testing.markdown import markdown_table, write_section

SECTION_NAME = "preset-loading"
SLACK_BYTES = 64 * 2**20
LOADERS = ("keras_from_preset", "keras_autoshard.from_preset")
CONFIG = dict(
    vocabulary_size=50304,
    num_layers=8,
    num_heads=16,
    hidden_dim=2048,
    intermediate_dim=8192,
    max_sequence_length=1024,
)
MiB = 2**20


def write_preset(directory: str) -> None:
    """Subprocess: build the task on one device and save it as a preset."""
    _setup_jax()
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(**CONFIG)
    task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    task.save_to_preset(directory)


def measure_load(directory: str, loader: str) -> dict:
    """Subprocess: load the preset under the distribution, measure memory."""
    _setup_jax()
    import keras_hub

    import keras_autoshard as ka

    distribution = ka.AutoShardDistribution(
        device_mesh=ka.MeshSpec((1, 8), ("batch", "model"))
    )
    rss_before = _rss_bytes("VmRSS")
    _reset_peak_rss()
    start = time.perf_counter()
    if loader == "keras_from_preset":
        with distribution.scope():
            task = keras_hub.models.GPT2CausalLM.from_preset(directory)
    else:
        task, _ = ka.from_preset(keras_hub.models.GPT2CausalLM, directory, distribution)
    for variable in task.variables:
        variable.value.block_until_ready()
    seconds = time.perf_counter() - start
    peak = _rss_bytes("VmHWM")
    _settle_memory(task)
    rss_after = _rss_bytes("VmRSS")
    slice_bytes = max(
        shard.data.nbytes
        for variable in task.variables
        for shard in variable.value.addressable_shards
    )
    weights_bytes = os.path.getsize(os.path.join(directory, "model.weights.h5"))
    return {
        "loader": loader,
        "seconds": seconds,
        "weights_bytes": weights_bytes,
        "rss_before": rss_before,
        "rss_after": rss_after,
        "peak": peak,
        "slice_bytes": slice_bytes,
    }


def _child(args: Sequence[str]) -> str:
    return run_child(args, module="benchmarks.preset_loading")


def run(directory: str | None = None) -> list[dict]:
    """Write the preset, measure every loader in its own process, clean up."""
    workdir = tempfile.mkdtemp(prefix="preset-bench-", dir=directory)
    try:
        preset = os.path.join(workdir, "preset")
        _child(["--child-write", preset])
        return [
            json.loads(
                _child(["--child-load", preset, "--loader", loader])
                .strip()
                .splitlines()[-1]
            )
            for loader in LOADERS
        ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def render(results: Sequence[dict], command: str) -> str:
    """The BENCHMARKS.md section."""
    rows = []
    for result in results:
        transient = max(0, result["peak"] - result["rss_after"])
        limit = result["slice_bytes"] + SLACK_BYTES
        rows.append(
            [
                f"`{result['loader']}`",
                f"{result['weights_bytes'] / 2**30:.2f} GiB",
                f"{result['seconds']:.1f} s",
                f"{transient / MiB:,.0f} MiB",
                f"{result['slice_bytes'] / MiB:,.1f} MiB",
                "yes" if transient <= limit else "no",
            ]
        )
    table = markdown_table(
        [
            "loader",
            "weights",
            "load time",
            "transient host memory",
            "largest device slice",
            "≤ slice + 64 MiB",
        ],
        rows,
    )
    return (
        "## Preset loading\n\n"
        "A 2 GB GPT-2-shaped `GPT2CausalLM` preset (written with "
        "`save_to_preset`) loaded under an `AutoShardDistribution` over 1 x 8 "
        "simulated devices. Transient host memory is the peak resident memory "
        "during the load above the resident size after it (read from "
        "`/proc/self/status`, each loader in a fresh process).\n\n"
        f"{table}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores. Command: "
        f"`{command}`.\n"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="Markdown file to rewrite the section of")
    parser.add_argument("--quick", action="store_true", help="same as without")
    parser.add_argument("--child-write", help=argparse.SUPPRESS)
    parser.add_argument("--child-load", help=argparse.SUPPRESS)
    parser.add_argument("--loader", choices=LOADERS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child_write:
        write_preset(args.child_write)
        return
    if args.child_load:
        print(json.dumps(measure_load(args.child_load, args.loader)))
        return
    command = "python -m benchmarks.preset_loading --output BENCHMARKS.md"
    markdown = render(run(), command)
    print(markdown)
    if args.output:
        write_section(args.output, SECTION_NAME, markdown)


if __name__ == "__main__":
    main()
