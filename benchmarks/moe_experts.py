"""KerasHub's MoE backbones: the automatic plan against KerasHub's own layout map.

Run from the repository root:

```
python -m benchmarks.moe_experts [--models MixtralBackbone ...]
    [--output BENCHMARKS.md] [--json PATH]
```

Each MoE backbone class (small configs: one layer, 8 experts, top 2) is planned
by `plan` on a 2x4 (data x model) mesh and one MSE/Adam training step compiled
under the plan and, where the class ships `get_layout_map`, under KerasHub's
map. The rows (collective operand bytes per device of each compiled train
step, their ratio, the all-to-all and all-reduce counts, where the experts dim
of the stacked expert kernels goes, parameter bytes per device ÷ ideal) replace
the `moe` section of the output file. The configs and the measurement are
`keras_autoshard/testing/moe_backbones.py`'s.
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
from keras_autoshard.plans.units import format_bytes  # noqa: E402
from keras_autoshard.testing.markdown import markdown_table, write_section  # noqa: E402
from keras_autoshard.testing.moe_backbones import (  # noqa: E402
    CONFIGS,
    HIDDEN,
    ROWS,
    SEQ,
    MoeRow,
    measure,
)

SECTION_NAME = "moe"


def render(rows: Sequence[MoeRow], command: str) -> str:
    table = markdown_table(
        [
            "model",
            "mesh",
            "auto bytes",
            "KerasHub map bytes",
            "auto ÷ map",
            "all-to-all / all-reduce",
            "expert kernels",
            "expert placement",
            "params ÷ ideal",
        ],
        [
            [
                row.model,
                row.mesh,
                format_bytes(row.auto_bytes),
                format_bytes(row.hub_bytes) if row.hub_bytes is not None else "n/a",
                f"{row.auto_bytes / row.hub_bytes:.2f}" if row.hub_bytes else "n/a",
                f"{row.auto_all_to_all} / {row.auto_all_reduce}",
                str(row.expert_kernels),
                row.expert_placement.split(";")[0],
                f"{row.params_over_ideal:.2f}",
            ]
            for row in rows
        ],
    )
    missing = "\n".join(f"- {r.model}: {r.hub_note}" for r in rows if r.hub_note)
    return (
        "## MoE backbones: expert parallelism vs KerasHub's layout map\n\n"
        f"Command: `{command}`\n\n"
        f"{machine_description()}; {versions()}. Small configs (1 layer, "
        f"hidden {HIDDEN}, 8 experts, top 2, batch {ROWS} × seq {SEQ}). Bytes: "
        "per-device operand bytes of every collective in the optimized HLO of "
        "one compiled MSE/Adam training step; the counts are the auto plan's. "
        "*expert placement* is the plan's note on the experts dim of the "
        "stacked expert kernels; *params ÷ ideal* is parameter bytes on the "
        "fullest device ÷ (all parameter bytes ÷ 8). KerasHub's MoE layers "
        "run every expert on every token (dense dispatch) and weight the "
        "outputs by the router, so with the experts dim cut each device runs "
        "its experts on its rows and XLA sums the weighted outputs with an "
        "all-reduce over the model axis: no op gathers tokens per expert, so "
        "no all-to-all appears (XLA chooses).\n\n"
        f"{table}\n\nNo KerasHub map:\n\n{missing}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CONFIGS))
    parser.add_argument("--output", default="BENCHMARKS.md")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = [measure(name) for name in args.models]
    command = "python -m benchmarks.moe_experts " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    write_section(args.output, SECTION_NAME, render(rows, command.strip()))
    if args.json:
        with open(args.json, "w") as file:
            json.dump([dataclasses.asdict(r) for r in rows], file, indent=1)


if __name__ == "__main__":
    main()
