"""PyTorch backend: host memory per rank of building a 2 GB model sharded over
4 torchrun ranks and loading its weights file.

Run from the repository root:

```
python -m benchmarks.torch_loading [--size-gib 2] [--output BENCHMARKS.md]
```

One subprocess writes a float32 `.weights.h5` of about `--size-gib` GiB (Dense
layers of width 8192, as `benchmarks.checkpoint_loading`). Then 4 gloo ranks
(`benchmarks/torch_loading_worker.py`) build the model under
`TensorParallel(..., distributed_backend="torch")` on a 1 x 4 mesh and load
the file, twice, each in a fresh launch:

- `full`: the model built whole on every rank, wrapped, `load_weights`;
- `abstract`: `TensorParallel(builder, weights=file)`: built shapes-only, each
  rank allocating and reading its own shards.

Each rank reports its peak resident memory during building and loading
above its resident memory before (after imports), read from
`/proc/self/status` with the peak counter reset. The bound is
1.25 × (file ÷ ranks) + 256 MiB. Rows replace the `torch-loading` section.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from benchmarks.checkpoint_loading import WIDTH, run_child
from benchmarks.report import machine_description
from keras_autoshard.testing.markdown import markdown_table, write_section

SECTION_NAME = "torch-loading"
WORKER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "torch_loading_worker.py"
)
RANKS = 4
MODES = ("full", "abstract")
SLACK_BYTES = 256 * 2**20
MiB = 2**20


def launch(mode: str, path: str, layers: int, out_dir: str) -> list[dict]:
    """One torchrun launch; every rank's result."""
    from tests.workers.torch_launch import free_port

    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={RANKS}", f"--master-port={free_port()}",
        WORKER, mode, path, str(layers), out_dir,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} launch failed:\n{done.stderr[-4000:]}")
    results = []
    for rank in range(RANKS):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as file:
            results.append(json.load(file))
        os.remove(os.path.join(out_dir, f"rank{rank}.json"))
    return results


def run(size_gib: float, directory: str | None = None) -> list[dict]:
    """Write the file, measure both modes, clean up."""
    layers = max(1, round(size_gib * 2**30 / (WIDTH * WIDTH * 4)))
    workdir = tempfile.mkdtemp(prefix="torch-loading-", dir=directory)
    try:
        path = os.path.join(workdir, "model.weights.h5")
        run_child(["--child-write", path, "--layers", str(layers)])
        return [row for mode in MODES for row in launch(mode, path, layers, workdir)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def bound(result: dict) -> float:
    return 1.25 * result["file_bytes"] / result["ranks"] + SLACK_BYTES


def render(results: Sequence[dict], command: str) -> str:
    rows = []
    for r in results:
        growth = r["peak"] - r["rss_before"]
        rows.append(
            [
                f"`{r['mode']}`",
                str(r["rank"]),
                f"{r['seconds']:.1f}",
                f"{r['rss_before'] / MiB:,.0f}",
                f"{growth / MiB:,.0f}",
                f"{r['shard_bytes'] / MiB:,.0f}",
                f"{bound(r) / MiB:,.0f}",
                "yes" if growth <= bound(r) else "no",
                "yes" if r["blocks_match_file"] else "NO",
            ]
        )
    table = markdown_table(
        [
            "build",
            "rank",
            "build + load (s)",
            "RSS before (MiB)",
            "peak growth (MiB)",
            "its shards (MiB)",
            "bound (MiB)",
            "within",
            "shards = file",
        ],
        rows,
        right_aligned=[False, True, True, True, True, True, True, False, False],
    )
    first = results[0]
    return (
        "## PyTorch backend: building and loading a 2 GB model on 4 ranks\n\n"
        f"{machine_description()}. A float32 `.weights.h5` of "
        f"{first['file_bytes'] / 1e9:.2f} GB (Dense layers of width {WIDTH}) is "
        f"loaded into the model sharded over {RANKS} torchrun ranks (gloo, CPU; "
        "the automatic plan cuts every kernel 4 ways on a 1 x 4 mesh). *Peak "
        "growth* is a rank's highest resident memory while building, planning, "
        "sharding and loading, minus its resident memory before building "
        "(after importing torch, Keras and TensorFlow, which Keras's "
        "serialisation imports on first use and KerasHub always: the *RSS "
        "before* column); the bound is 1.25 × (file ÷ ranks) + "
        "256 MiB. `full` is the usual path (every rank builds the whole model, "
        "then shards it); `abstract` is `TensorParallel(builder, weights=file)`. "
        "Rank 0 plans from shapes in a JAX subprocess (a process of its own, not "
        "counted). *Shards = file*: every local block equals the file's. "
        "Regenerate with:\n\n"
        f"```\n{command}\n```\n\n{table}\n"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.torch_loading", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--output", help="Markdown file whose section to rewrite")
    parser.add_argument("--tmp-dir", help="where to write the temporary file")
    parser.add_argument("--json", help="also write the raw rows here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    results = run(args.size_gib, args.tmp_dir)
    command = "python -m benchmarks.torch_loading --output BENCHMARKS.md"
    section = render(results, command)
    print(section)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)
    if args.output:
        write_section(args.output, SECTION_NAME, section)


if __name__ == "__main__":
    main()
