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
the `moe` section of the output file. `tests/test_moe_hub.py` uses the same
configs.
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

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.markdown import markdown_table, write_section  # noqa: E402
from benchmarks.measure import compiled_report  # noqa: E402
from benchmarks.report import machine_description, versions  # noqa: E402
from benchmarks.strategies import (  # noqa: E402
    StrategyNotApplicable,
    keras_hub_layout_map,
)
from keras_autoshard import (  # noqa: E402
    MeshSpec,
    PlanDistribution,
    plan,
)
from keras_autoshard.plans.units import format_bytes  # noqa: E402

SECTION_NAME = "moe"
MESH_2x4 = MeshSpec((2, 4), ("batch", "model"))
VOCAB, SEQ, HIDDEN, ROWS = 64, 8, 32, 8
ATTENTION = dict(num_query_heads=8, num_key_value_heads=4, hidden_dim=HIDDEN)
CONFIGS = {
    "MixtralBackbone": dict(intermediate_dim=64, num_experts=8, top_k=2),
    "QwenMoeBackbone": dict(
        intermediate_dim=64,
        moe_intermediate_dim=16,
        shared_expert_intermediate_dim=32,
        num_experts=8,
        top_k=2,
    ),
    "Qwen3MoeBackbone": dict(
        intermediate_dim=64, moe_intermediate_dim=16, num_experts=8, top_k=2
    ),
    "GptOssBackbone": dict(intermediate_dim=64, num_experts=8, top_k=2),
}


def builder(name: str):
    """A function building a one-layer `name` backbone from `CONFIGS`."""

    def build() -> keras.Model:
        return getattr(keras_hub.models, name)(
            vocabulary_size=VOCAB, num_layers=1, **ATTENTION, **CONFIGS[name]
        )

    return build


def tokens(rows: int = ROWS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(0, VOCAB, (rows, SEQ)).astype("int32"),
        "padding_mask": np.ones((rows, SEQ), "int32"),
    }


def targets(rows: int = ROWS) -> np.ndarray:
    rng = np.random.default_rng(1)
    return rng.standard_normal((rows, SEQ, HIDDEN)).astype("float32")


@dataclasses.dataclass
class MoeRow:
    """One MoE backbone on one mesh.

    Attributes:
        model: The `keras_hub.models` class.
        mesh: e.g. "2x4".
        auto_bytes: Collective operand bytes per device, compiled auto plan.
        hub_bytes: The same under KerasHub's `get_layout_map`, or None.
        hub_note: Why there is no KerasHub figure ("" when there is one).
        auto_all_to_all: All-to-all count in the auto plan's train step.
        auto_all_reduce: All-reduce count in the auto plan's train step.
        expert_kernels: Stacked expert kernels found (experts-dim role).
        expert_placement: The plan's note on where the experts go.
        params_over_ideal: Parameter bytes on the fullest device ÷ ideal.
    """

    model: str
    mesh: str
    auto_bytes: int
    hub_bytes: int | None
    hub_note: str
    auto_all_to_all: int
    auto_all_reduce: int
    expert_kernels: int
    expert_placement: str
    params_over_ideal: float


def measure(name: str, mesh: MeshSpec = MESH_2x4) -> MoeRow:
    build, x, y = builder(name), tokens(), targets()
    auto_plan = plan(build, mesh, sample_input=x)
    auto = compiled_report(build, PlanDistribution(auto_plan), x, y)
    try:
        hub = compiled_report(build, keras_hub_layout_map(build, mesh), x, y)
        hub_bytes, hub_note = hub.train_step.operand_bytes(), ""
    except StrategyNotApplicable as reason:
        hub_bytes, hub_note = None, str(reason)
    experts = [v for v in auto_plan.variables if "experts" in v.roles]
    placement = [n for n in auto_plan.notes if "experts" in n.split(".")[0]]
    total = sum(v.total_bytes for v in auto_plan.variables)
    return MoeRow(
        model=name,
        mesh="x".join(map(str, mesh.shape)),
        auto_bytes=auto.train_step.operand_bytes(),
        hub_bytes=hub_bytes,
        hub_note=hub_note,
        auto_all_to_all=auto.train_step.count("all-to-all"),
        auto_all_reduce=auto.train_step.count("all-reduce"),
        expert_kernels=len(experts),
        expert_placement=placement[0] if placement else "no experts dim found",
        params_over_ideal=auto.parameter_bytes_per_device * mesh.device_count / total,
    )


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
