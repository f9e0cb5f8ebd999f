"""Model coverage: every exported KerasHub backbone, planned and checked per mesh.

Run from the repository root:

```
python -m benchmarks.model_coverage [--classes BertBackbone ...]
    [--meshes 2x4 1x8 8x1] [--output BENCHMARKS.md] [--json PATH]
```

For every `Backbone` class that `keras_hub` exports
(`keras_autoshard/testing/hub_backbones`: small configs, no downloads) the
model is built once on one device and its forward pass compiled there (the
reference). Then, for each mesh, an
`AutoShardDistribution` plans it on the test batch (`prepare`: plan, then move
every variable onto its planned layout device to device), the same forward
pass is compiled under the distribution's scope, and its outputs are compared
with the reference. The rows (status, plan seconds, share of parameter bytes
that are cut, parameter bytes on the fullest device ÷ the ideal total ÷
devices, read from the variables' addressable shards, whether the batch is
split or why not, and the parity) replace the `model-coverage` section of the
output file.

The checks are `keras_autoshard/testing/model_coverage.py`'s;
`tests/test_model_coverage.py` (text classes) and
`tests/test_model_coverage_images.py` (the others) run the same
`check_on_mesh` on every class and assert what it measures.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from keras_autoshard.runtime.devices import simulate_devices  # noqa: E402

DEVICE_COUNT = 8
simulate_devices(DEVICE_COUNT)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from benchmarks.report import machine_description, versions  # noqa: E402
from keras_autoshard.plans.mesh import entry_axes, entry_text  # noqa: E402
from keras_autoshard.testing.hub_backbones import CASES  # noqa: E402
from keras_autoshard.testing.markdown import markdown_table, write_section  # noqa: E402
from keras_autoshard.testing.model_coverage import (  # noqa: E402
    BATCH_SIZE,
    MESHES,
    CoverageRow,
    run,
)

SECTION_NAME = "model-coverage"


def render(rows: Sequence[CoverageRow], command: str) -> str:
    """The `model-coverage` section: one row per class × mesh."""
    table = markdown_table(
        [
            "class",
            "modality",
            "mesh",
            "status",
            "plan s",
            "params",
            "bytes cut",
            "per device ÷ ideal",
            "batch",
            "parity",
        ],
        [
            [row.class_name, row.modality, row.mesh, row.status, *_measured(row)]
            for row in rows
        ],
    )
    ok = sum(row.status == "ok" for row in rows)
    failing = sorted({row.class_name for row in rows if row.status != "ok"})
    whole = sorted(
        {
            row.class_name
            for row in rows
            if row.status == "ok" and row.batch_axis is None
        }
    )
    spanning = sorted(
        {
            row.class_name
            for row in rows
            if row.status == "ok" and len(entry_axes(row.batch_axis)) > 1
        }
    )
    summary = f"{ok} of {len(rows)} class × mesh rows pass"
    if failing:
        summary += f"; the others fail with the error shown ({', '.join(failing)})"
    if whole:
        summary += "; the batch is kept whole, for the reason shown, in " + ", ".join(
            whole
        )
    if spanning:
        summary += (
            "; the batch is cut over every axis of 2x4 (`batch+model`: a grouped "
            "convolution's channels cannot take 'model', and XLA needs every "
            "axis to cut its input) in " + ", ".join(spanning)
        )
    return (
        "## Model coverage: every exported KerasHub backbone\n\n"
        f"Command: `{command}`\n\n"
        f"{machine_description()}; {versions()}. Each backbone is built once from "
        "a small config (`keras_autoshard/testing/hub_backbones`, batch "
        f"{BATCH_SIZE}), planned by `AutoShardDistribution.prepare` on each mesh "
        "and run forward against the same weights on one device. `bytes cut`: "
        "share of parameter bytes in variables cut over some mesh axis; "
        "`per device ÷ ideal`: parameter bytes on the fullest device ÷ (all "
        "parameter bytes ÷ 8), read from the arrays' addressable shards (small "
        "configs: biases and norms that are too small to be worth cutting weigh "
        "more than in real sizes); `batch`: the axis the batch is split over, or "
        "why it is kept whole; `parity`: largest relative error of any output. "
        "On 1x8 (no data axis of size > 1) the batch may go over 'model': the "
        "planner first leaves the least compute repeated on the devices, then "
        "moves the fewest bytes.\n\n"
        f"{summary}.\n\n{table}\n"
    )


def _measured(row: CoverageRow) -> list[str]:
    if row.status != "ok":
        return ["—"] * 6
    return [
        f"{row.plan_seconds:.1f}",
        f"{row.parameter_bytes / 1024:.0f} KiB",
        f"{row.sharded_share:.0%}",
        f"{row.per_device_over_ideal:.2f}",
        _batch_cell(row),
        f"{row.parity:.1e}",
    ]


def _batch_cell(row: CoverageRow) -> str:
    if row.batch_axis is not None:
        return entry_text(row.batch_axis)
    if "kept whole on every device: " in row.batch_note:
        why = row.batch_note.split("kept whole on every device: ")[1]
    elif "Why: " in row.batch_note:
        why = row.batch_note.split("Why: ")[1].split(". The batch")[0]
    else:
        why = ""
    return f"whole: {why[:160]}" if why else "whole"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", nargs="+", default=sorted(CASES))
    parser.add_argument("--meshes", nargs="+", default=list(MESHES))
    parser.add_argument("--output", default="BENCHMARKS.md")
    parser.add_argument("--json", default=None, help="also write the rows here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run(args.classes, args.meshes)
    shown = [a for a in (sys.argv[1:] if argv is None else argv)]
    if "--json" in shown:
        del shown[shown.index("--json") : shown.index("--json") + 2]
    command = "python -m benchmarks.model_coverage " + shlex.join(shown)
    write_section(args.output, SECTION_NAME, render(rows, command.strip()))
    if args.json:
        with open(args.json, "w") as file:
            json.dump([dataclasses.asdict(row) for row in rows], file, indent=1)


if __name__ == "__main__":
    main()
