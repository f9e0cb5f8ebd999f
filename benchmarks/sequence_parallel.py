"""Sequence parallelism: compiled memory and communication against the same
plan without it.

Run from the repository root:

```
python -m benchmarks.sequence_parallel [--output BENCHMARKS.md]
```

Every transformer of the test zoo (batch 8 × 64 tokens) on 8 simulated
devices, meshes 1x4 (four of them) and 2x4, planned with and without
`sequence_parallel=True`. For each: the compiled train step's peak per
device (XLA memory analysis: arguments + outputs + temporaries − aliased)
with XLA:CPU's default schedule and scheduled for memory
(`MEMORY_SCHEDULE_ON_CPU`), the plan's estimated peak, and the bytes one
device sends per step on a ring (`CollectiveOp.ring_bytes`: XLA:CPU writes
a reduce-scatter as an all-reduce sliced by partition, counted as the
reduce-scatter it is). Models the planner leaves out say why.

Rows replace the `sequence-parallel` section of the output file.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from keras_autoshard.runtime.devices import simulate_devices  # noqa: E402

simulate_devices(8)

import argparse  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from benchmarks.report import machine_description  # noqa: E402
from keras_autoshard.plans.units import format_bytes  # noqa: E402
from keras_autoshard.testing.markdown import markdown_table, write_section  # noqa: E402

SECTION_NAME = "sequence-parallel"
MODELS = ("gpt2", "bert", "opt", "gemma", "llama", "subclassed")
MESHES = ((1, 4), (2, 4))
COMMAND = "python -m benchmarks.sequence_parallel --output BENCHMARKS.md"


def measure(name: str, shape: tuple[int, int]) -> dict:
    """One model on one mesh, with and without sequence parallelism."""
    from keras_autoshard import MeshSpec, plan
    from keras_autoshard.report.compiled_program import MEMORY_SCHEDULE_ON_CPU
    from keras_autoshard.report.estimate_check import compiled_peak_bytes
    from keras_autoshard.report.hlo.schedules import schedule_peaks
    from keras_autoshard.testing import zoo
    from keras_autoshard.testing.compiled import compiled_as_planned

    build, batch = zoo.ZOO[name]
    x = batch()
    y = zoo.random_targets(build, x)
    mesh = MeshSpec(shape, ("batch", "model"))
    row = {"model": name, "mesh": f"{shape[0]}x{shape[1]}"}
    plans = {
        "tp": plan(build, mesh, x),
        "sp": plan(build, mesh, x, sequence_parallel=True),
    }
    applied = any(
        lever.startswith("sequence parallelism")
        for lever in plans["sp"].estimate.levers
    )
    row["applied"] = applied
    row["why_not"] = "; ".join(
        n for n in plans["sp"].notes if n.startswith("Sequence parallelism")
    )
    for key, sharding_plan in plans.items():
        row[f"{key}_estimate"] = sharding_plan.estimate.peak_bytes
        for schedule, options in (
            ("default", None),
            ("memory", MEMORY_SCHEDULE_ON_CPU),
        ):
            step = compiled_as_planned(
                sharding_plan, build, x, y, compiler_options=options
            ).train_step
            row[f"{key}_{schedule}"] = compiled_peak_bytes(step.memory)
            if schedule == "default":
                row[f"{key}_ring"] = sum(op.ring_bytes for op in step.collectives)
            else:
                row[f"{key}_least"] = schedule_peaks(step.hlo_text).least
        if not applied:
            break
    return row


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}"


def render(rows: Sequence[dict]) -> str:
    """The section's Markdown."""
    table = []
    for row in rows:
        if not row["applied"]:
            table.append(
                [row["model"], row["mesh"], "left out: " + row["why_not"]] + [""] * 8
            )
            continue
        table.append(
            [
                row["model"],
                row["mesh"],
                f"{format_bytes(row['tp_default'])} → "
                f"{format_bytes(row['sp_default'])}",
                _ratio(row["sp_default"], row["tp_default"]),
                f"{format_bytes(row['tp_memory'])} → {format_bytes(row['sp_memory'])}",
                _ratio(row["sp_memory"], row["tp_memory"]),
                f"{format_bytes(row['tp_least'])} → {format_bytes(row['sp_least'])}",
                _ratio(row["sp_least"], row["tp_least"]),
                f"{format_bytes(row['tp_ring'])} → {format_bytes(row['sp_ring'])}",
                _ratio(row["sp_ring"], row["tp_ring"]),
                f"{_ratio(row['tp_estimate'], row['tp_memory'])} / "
                f"{_ratio(row['sp_estimate'], row['sp_memory'])}",
            ]
        )
    header = [
        "model",
        "mesh",
        "compiled peak, default schedule (TP → SP)",
        "SP ÷ TP",
        "compiled peak, scheduled for memory (TP → SP)",
        "SP ÷ TP",
        "least of list / depth-first / post order, replayed (TP → SP)",
        "SP ÷ TP",
        "ring bytes per step (TP → SP)",
        "SP ÷ TP",
        "estimate ÷ compiled (TP / SP)",
    ]
    return (
        "## Sequence parallelism\n\n"
        f"Regenerate: `{COMMAND}`. Machine: {machine_description()}.\n\n"
        "Each zoo transformer (batch 8 × 64 tokens, float32) planned without "
        "and with `sequence_parallel=True` on the same mesh; the "
        "tensor-parallel sharding is the same, the tokens of the activations "
        "between its regions are cut over `model`. Peak per device of the "
        "compiled train step (XLA memory analysis), with XLA:CPU's default "
        "schedule (ordered for throughput) and scheduled for memory with its "
        "optimization barriers kept (`MEMORY_SCHEDULE_ON_CPU`, as accelerators "
        "compile, the program estimates are checked against; XLA:CPU's memory "
        "scheduler is depth-first only), "
        "and that program's instructions replayed in the order of least peak "
        "among a list, a depth-first and a post-order schedule, the choice "
        "XLA:GPU's memory scheduler makes (`report/hlo/schedules.py`: bytes "
        "live, no buffer sharing). Ring bytes: what one device sends per step "
        "under ring algorithms (an all-reduce 2(g−1)/g of its bytes, a "
        "reduce-scatter, written by XLA:CPU as an all-reduce sliced by "
        "partition, and an all-gather (g−1)/g). Estimate: the plan's peak over "
        "the memory-scheduled one's; it counts each cut tensor a column-parallel "
        "matmul reads at its whole size (the gathered copy the backward pass "
        "keeps for the weight gradient) and each row-parallel output cut (laid "
        "out whole, held reduce-scattered).\n\n" + markdown_table(header, table) + "\n"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sequence_parallel",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--output", default="BENCHMARKS.md")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    rows = [measure(name, shape) for shape in MESHES for name in args.models]
    for row in rows:
        print(row, flush=True)
    write_section(args.output, SECTION_NAME, render(rows))


if __name__ == "__main__":
    main()
