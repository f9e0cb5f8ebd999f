"""PyTorch backend under torchrun: step time and collective bytes per rank.

A KerasHub GPT-2 (2 layers, hidden 256, batch 8 × seq 128, dropout 0) is
trained with Adam in one process (unsharded, the baseline) and sharded over
2 and 4 gloo ranks on this machine's CPU with the automatic plan. Writes the
`torch-ranks` section of BENCHMARKS.md.

    python -m benchmarks.torch_ranks [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import tempfile

from benchmarks.report import machine_description
from keras_autoshard.plans.units import format_bytes
from keras_autoshard.testing.markdown import markdown_table, write_section

SECTION_NAME = "torch-ranks"
WORKER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "torch_rank_worker.py"
)
MESHES = ("1x2", "2x1", "1x4", "2x2")
COMMAND = "python -m benchmarks.torch_ranks --output BENCHMARKS.md"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(mesh_text: str) -> dict:
    """One configuration's figures (rank 0's), from a fresh launch."""
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        if mesh_text == "single":
            command = [sys.executable, WORKER, "single", out]
        else:
            ranks = math.prod(int(s) for s in mesh_text.split("x"))
            command = [
                sys.executable, "-m", "torch.distributed.run",
                f"--nproc-per-node={ranks}", f"--master-port={_free_port()}",
                WORKER, mesh_text, out,
            ]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=600
        )
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{mesh_text} failed:\n{done.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def megatron_model_axis_bytes(mesh_text: str) -> int:
    """2 + 2 all-reduces of (b/data)·s·h fp32 per layer over the model axis."""
    from benchmarks.torch_rank_worker import BATCH, CONFIG, SEQ

    data, model = (int(s) for s in mesh_text.split("x"))
    if model == 1:
        return 0
    per_layer = 4 * (BATCH // data) * SEQ * CONFIG["hidden_dim"] * 4
    return CONFIG["num_layers"] * per_layer


def render(results: dict[str, dict]) -> str:
    single = results["single"]["step_s"]
    rows = [["1 (unsharded)", "-", f"{single * 1e3:.0f} ms", "1.00", "0", "-", "-"]]
    for mesh_text in MESHES:
        result = results[mesh_text]
        counts = result["collectives"]
        total = sum(b for _, b in counts.values())
        kinds = ", ".join(f"{n} {c}×" for n, (c, _) in sorted(counts.items()))
        minimum = megatron_model_axis_bytes(mesh_text)
        rows.append(
            [
                str(result["ranks"]),
                mesh_text,
                f"{result['step_s'] * 1e3:.0f} ms",
                f"{result['step_s'] / single:.2f}",
                format_bytes(total),
                kinds,
                format_bytes(minimum) if minimum else "0 (data parallel)",
            ]
        )
    headers = [
        "ranks", "mesh data×model", "step (median of 5)", "÷ one process",
        "collective bytes / rank / step", "collectives", "Megatron model-axis min",
    ]  # fmt: skip
    return (
        "## PyTorch backend: torchrun ranks vs one process\n\n"
        f"Generated {datetime.date.today().isoformat()} on {machine_description()}; "
        f"torch {_torch_version()}, gloo on CPU, one thread per rank. KerasHub "
        "GPT-2 (2 layers, hidden 256, 8 heads, batch 8 × seq 128, dropout 0), "
        "Adam, MSE, automatic plan applied as DTensor placements. Regenerate "
        f"with:\n\n```\n{COMMAND}\n```\n\n"
        + markdown_table(headers, rows, [False, False, True, True, True, False, True])
        + "\n\nBytes are the inputs of every functional collective DTensor issued "
        "in one training step on rank 0 (exact, counted at the call). The "
        "Megatron column is the model-axis part only (2 + 2 all-reduces of "
        "(b/data)·s·h per layer); the rest is the embedding and final-norm "
        "all-reduces and, with a data axis, the gradient all-reduce. Several "
        "ranks share 2 CPU cores here, so step ratios above 1 measure the "
        "machine, not the method.\n"
    )


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="Markdown file to write the section to")
    args = parser.parse_args(argv)
    results = {name: run_case(name) for name in ("single", *MESHES)}
    section = render(results)
    print(section)
    if args.output:
        write_section(args.output, SECTION_NAME, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
