"""Host memory and throughput of loading a Keras weights file onto 8 devices.

Run from the repository root:

```
python -m benchmarks.checkpoint_loading [--size-gib 2] [--output BENCHMARKS.md]
```

One subprocess builds a model of about `--size-gib` GiB of float32 weights (Dense
layers of width 8192) and writes it with `model.save_weights`. Then, for each
loader, a fresh subprocess creates the same model sharded over 8 simulated
devices (every kernel cut over the `model` axis of a 1 x 8 mesh), resets the
kernel's peak-RSS counter (`/proc/self/clear_refs`), loads the file, and
reports the peak resident memory above the final resident size (the
transient host memory of the load) and the load throughput. Loaders: Keras's
`model.load_weights` and `keras_autoshard.load_weights_sharded`. The file is
read from a warm page cache (it was just written). Temporary files are
removed. Without `--output` the table is printed only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from keras_autoshard.testing.markdown import markdown_table, write_section

SECTION_NAME = "checkpoint-loading"
DEVICE_COUNT = 8
WIDTH = 8192
SLACK_BYTES = 64 * 2**20
LOADERS = ("keras_load_weights", "load_weights_sharded")
MiB = 2**20


# ------------------------------------------------------------ in subprocesses
def _setup_jax() -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from keras_autoshard.runtime.devices import simulate_devices

    simulate_devices(DEVICE_COUNT)


def _build_model(layer_count: int):
    import keras

    layers = [keras.Input((WIDTH,))]
    layers += [keras.layers.Dense(WIDTH, name=f"dense_{i}") for i in range(layer_count)]
    return keras.Sequential(layers, name="checkpoint_benchmark")


def _sharded_model(layer_count: int):
    import keras

    from keras_autoshard import MeshSpec, PlanDistribution, plan_from_rules

    mesh = MeshSpec((1, DEVICE_COUNT), ("batch", "model"))
    with keras.StatelessScope():  # shapes only, for the plan
        reference = _build_model(layer_count)
    plan = plan_from_rules(
        reference.variables, mesh, {r".*/kernel": (None, "model")}, "batch"
    )
    with PlanDistribution(plan).scope():
        return _build_model(layer_count)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _settle_memory(model) -> None:
    """Finish pending work and hand freed heap memory back to the OS, so that
    RSS counts live data only (freed buffers otherwise linger in it)."""
    import ctypes
    import gc

    for variable in model.variables:
        variable.value.block_until_ready()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def write_file(path: str, layer_count: int) -> None:
    """Subprocess: build the model on one device and save its weights."""
    _setup_jax()
    model = _build_model(layer_count)
    model.save_weights(path)


def measure_load(path: str, layer_count: int, loader: str) -> dict:
    """Subprocess: create the sharded model, load `path`, measure memory."""
    _setup_jax()
    import time

    from keras_autoshard import load_weights_sharded

    model = _sharded_model(layer_count)
    slice_bytes = max(
        shard.data.nbytes
        for variable in model.variables
        for shard in variable.value.addressable_shards
    )
    _settle_memory(model)
    rss_before = _rss_bytes("VmRSS")
    _reset_peak_rss()
    start = time.perf_counter()
    if loader == "keras_load_weights":
        model.load_weights(path)
    else:
        load_weights_sharded(model, path)
    for variable in model.variables:
        variable.value.block_until_ready()
    seconds = time.perf_counter() - start
    peak = _rss_bytes("VmHWM")
    _settle_memory(model)
    rss_after = _rss_bytes("VmRSS")
    return {
        "loader": loader,
        "seconds": seconds,
        "file_bytes": os.path.getsize(path),
        "rss_before": rss_before,
        "rss_after": rss_after,
        "peak": peak,
        "slice_bytes": slice_bytes,
        "bytes_per_device": sum(
            variable.value.addressable_shards[0].data.nbytes
            for variable in model.variables
        ),
    }


# ----------------------------------------------------------------- the driver
def run_child(
    args: Sequence[str], module: str = "benchmarks.checkpoint_loading"
) -> str:
    """Run `python -m module *args` and return its stdout (raise on failure)."""
    command = [sys.executable, "-m", module, *args]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(command)} failed (rc {result.returncode}):\n"
            f"{result.stderr[-4000:]}"
        )
    return result.stdout


def run(size_gib: float, directory: str | None = None) -> list[dict]:
    """Write the file, measure every loader in its own process, clean up."""
    layer_count = max(1, round(size_gib * 2**30 / (WIDTH * WIDTH * 4)))
    workdir = tempfile.mkdtemp(prefix="ckpt-bench-", dir=directory)
    try:
        path = os.path.join(workdir, "model.weights.h5")
        run_child(["--child-write", path, "--layers", str(layer_count)])
        results = []
        for loader in LOADERS:
            out = run_child(
                ["--child-load", path, "--layers", str(layer_count), "--loader", loader]
            )
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def render(results: Sequence[dict], command: str) -> str:
    """The Markdown section for `results`."""
    rows = []
    for r in results:
        transient = r["peak"] - r["rss_after"]
        target = r["slice_bytes"] + SLACK_BYTES
        rows.append(
            [
                f"`{r['loader']}`",
                f"{r['file_bytes'] / 1e9:.2f}",
                f"{r['seconds']:.2f}",
                f"{r['file_bytes'] / 1e9 / r['seconds']:.2f}",
                f"{r['rss_after'] / MiB:,.0f}",
                f"{transient / MiB:,.0f}",
                f"{r['slice_bytes'] / MiB:,.0f}",
                "yes" if transient <= target else "no",
            ]
        )
    table = markdown_table(
        [
            "loader",
            "file (GB)",
            "load (s)",
            "GB/s",
            "final RSS (MiB)",
            "peak above final (MiB)",
            "largest device slice (MiB)",
            "≤ slice + 64 MiB",
        ],
        rows,
        right_aligned=[False, True, True, True, True, True, True, False],
    )
    return (
        "## Loading a Keras weights file onto 8 devices\n\n"
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}. A float32 `.weights.h5` of "
        f"{results[0]['file_bytes'] / 1e9:.2f} GB (Dense layers of width {WIDTH}) "
        "is loaded into the same model created sharded over 8 simulated host "
        "devices (kernels cut over a 1 x 8 mesh); each loader runs in a fresh "
        "process. *Peak above final* is the highest resident memory during the "
        "load minus the resident memory after it: the host memory the load "
        "needs beyond the model itself. Simulated devices live in host memory, "
        "so the final RSS includes every device's slices; the file is read from "
        "a warm page cache. Regenerate with:\n\n"
        f"```\n{command}\n```\n\n{table}\n"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint_loading",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--output", help="Markdown file whose section to rewrite")
    parser.add_argument("--tmp-dir", help="where to write the temporary file")
    parser.add_argument("--child-write", help=argparse.SUPPRESS)
    parser.add_argument("--child-load", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--loader", choices=LOADERS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child_write:
        write_file(args.child_write, args.layers)
        return
    if args.child_load:
        print(json.dumps(measure_load(args.child_load, args.layers, args.loader)))
        return
    results = run(args.size_gib, args.tmp_dir)
    command = "python -m benchmarks.checkpoint_loading" + (
        f" --size-gib {args.size_gib:g}" if args.size_gib != 2.0 else ""
    )
    command += " --output BENCHMARKS.md"
    section = render(results, command)
    print(section)
    if args.output:
        write_section(args.output, SECTION_NAME, section)


if __name__ == "__main__":
    main()
