"""The automatic planner against hand-written and KerasHub layouts, per mesh.

Run from the repository root:

```
python -m benchmarks.planner_zoo [--quick] [--output BENCHMARKS.md]
    [--models gpt2 llama] [--meshes 2x4 1x8] [--json PATH]
```

For every KerasHub backbone of the acceptance zoo
(`keras_autoshard/testing/zoo.py`: small configs, no downloads) and every
mesh, each strategy is built, compiled, inspected and timed on 8 simulated
host devices in this one process:
`auto` (`AutoShardDistribution`, no budget), `auto_budget` (a whole-peak
budget leaving the state 1.05 × (parameter + Adam bytes) ÷ devices), `handwritten` (the
Megatron plan of `keras_hub_megatron_plan`), `keras_hub_map` (the
backbone's own `get_layout_map`, where it has one) and `single` (one device,
the timing baseline). The results replace the `planner-zoo` section of the
output file.
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
import functools  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402

from benchmarks.measure import CaseResult, Measurement, measure_case  # noqa: E402
from benchmarks.models import FP32_BYTES, MegatronMinimum, ModelCase  # noqa: E402
from benchmarks.report import machine_description, versions  # noqa: E402
from benchmarks.strategies import STRATEGIES  # noqa: E402
from keras_autoshard import AutoShardDistribution, MeshSpec, plan  # noqa: E402
from keras_autoshard.building import names_replayed_after  # noqa: E402
from keras_autoshard.errors import PlanError  # noqa: E402
from keras_autoshard.plans.estimate import HEADROOM  # noqa: E402
from keras_autoshard.plans.mesh import DATA_AXIS, MODEL_AXIS  # noqa: E402
from keras_autoshard.plans.units import format_bytes  # noqa: E402
from keras_autoshard.testing import zoo  # noqa: E402
from keras_autoshard.testing.markdown import markdown_table, write_section  # noqa: E402
from keras_autoshard.testing.reference_plans import (  # noqa: E402
    StrategyNotApplicable,
    handwritten_plan,
)

SECTION_NAME = "planner-zoo"
MODEL_NAMES = ("gpt2", "bert", "opt", "gemma", "llama")
MESHES = {
    "2x4": MeshSpec((2, 4), (DATA_AXIS, MODEL_AXIS)),
    "1x8": MeshSpec((1, 8), (DATA_AXIS, MODEL_AXIS)),
    "8x1": MeshSpec((8, 1), (DATA_AXIS, MODEL_AXIS)),
}
STRATEGY_NAMES = ("single", "auto", "auto_budget", "handwritten", "keras_hub_map")
BUDGET_FACTOR = 1.05
ADAM_COPIES = 3  # the parameter and Adam's two moments
TIMED_STEPS = 5
QUICK_TIMED_STEPS = 2


def auto_with_budget(
    build_model, mesh: MeshSpec, sample_input
) -> AutoShardDistribution:
    """`AutoShardDistribution` under a whole-peak budget that leaves the
    state (parameters and Adam's moments) 1.05 × its even share,
    1.05 × (P + O) ÷ devices: the free plan's estimated peak with its own
    parameters and optimizer state replaced by that share (and the
    planner's headroom added back).

    The plan is tried first (no weights allocated) so that a budget no plan
    fits is reported as such instead of failing the whole run.
    """
    free = plan(build_model, mesh, sample_input=sample_input).estimate
    state = BUDGET_FACTOR * ADAM_COPIES * _parameter_bytes(build_model) / 8
    rest = free.peak_bytes - free.parameter_bytes - free.optimizer_bytes
    budget = int((rest + state) / (1 - HEADROOM["XLA:CPU"]))
    try:
        plan(build_model, mesh, sample_input=sample_input, memory_budget=budget)
    except PlanError as error:
        raise StrategyNotApplicable(str(error)) from None
    return AutoShardDistribution(device_mesh=mesh, memory_budget=budget)


def _parameter_bytes(build_model) -> int:
    with names_replayed_after():
        model = build_model()
    unique = {id(v): v for v in model.variables}.values()
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in unique)


def zoo_case(name: str) -> ModelCase:
    """A benchmark case for the zoo model `name`: MSE on random targets."""
    build, batch = zoo.ZOO[name]

    def batch_with_targets():
        x = batch()
        return x, zoo.random_targets(build, x)

    return ModelCase(
        build=build,
        batch=batch_with_targets,
        megatron_minimum=transformer_minimum,
        description=f"zoo {name}",
    )


def transformer_minimum(model: keras.Model, mesh: MeshSpec) -> MegatronMinimum:
    """Megatron's minimum for a transformer backbone on `mesh`.

    Per layer two all-reduces of the per-device activation (b/data)·s·h·4
    over the model axis forward and two backward (none when the model axis
    has size 1), plus the all-reduce over the data axis of the gradients of
    the Megatron plan's per-device parameters (none when the data axis has
    size 1).
    """
    config = model.get_config()
    layers, hidden = config["num_layers"], config["hidden_dim"]
    data, tensor = mesh.axis_size(DATA_AXIS), mesh.axis_size(MODEL_AXIS)
    activation = zoo.BATCH // data * zoo.SEQ * hidden * FP32_BYTES
    activation_bytes = layers * 4 * activation if tensor > 1 else 0
    gradient_bytes = handwritten_plan(model, mesh).bytes_per_device() if data > 1 else 0
    return MegatronMinimum(
        activation_bytes=activation_bytes,
        gradient_bytes=gradient_bytes,
        formula=f"{layers} layers × 4 × (b/data)·s·h·4",
    )


@dataclasses.dataclass(frozen=True)
class ZooRow:
    """Every strategy's result for one (model, mesh), and the minimum."""

    model: str
    mesh: str
    minimum: MegatronMinimum
    results: dict[str, CaseResult]

    def measured(self, strategy: str) -> Measurement | None:
        result = self.results.get(strategy)
        return result if isinstance(result, Measurement) else None


def run(
    model_names: Sequence[str], mesh_names: Sequence[str], timed_steps: int
) -> list[ZooRow]:
    """Measure every (model, mesh, strategy), with a progress bar."""
    rows = []
    total = len(model_names) * len(mesh_names) * len(STRATEGY_NAMES)
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task("planner zoo", total=total)
        for name in model_names:
            case = zoo_case(name)
            for mesh_name in mesh_names:
                mesh = MESHES[mesh_name]
                with names_replayed_after():
                    reference = case.build()
                minimum = transformer_minimum(reference, mesh)
                strategies = dict(
                    STRATEGIES,
                    auto_budget=functools.partial(
                        auto_with_budget, sample_input=case.batch()[0]
                    ),
                )
                results = {}
                for strategy in STRATEGY_NAMES:
                    progress.update(task, description=f"{name} {mesh_name} {strategy}")
                    results[strategy] = measure_case(
                        name,
                        case,
                        strategy,
                        strategies[strategy],
                        mesh,
                        timed_steps,
                    )
                    progress.advance(task)
                rows.append(ZooRow(name, mesh_name, minimum, results))
    return rows


COLUMNS = (
    ("model", False),
    ("mesh", False),
    ("auto", True),
    ("÷ handwritten", True),
    ("÷ KerasHub map", True),
    ("÷ Megatron min", True),
    ("auto params ÷ ideal", True),
    ("auto_budget", True),
    ("budget state/device", True),
    ("÷ KerasHub map ", True),
    ("auto step ÷ single", True),
    ("handwritten step ÷ single", True),
)


def render(rows: Sequence[ZooRow], timed_steps: int, command: str) -> str:
    """The section's Markdown: header, table, how to read it."""
    import datetime

    table_rows = [_table_row(row) for row in rows]
    headers = [title.strip() for title, _ in COLUMNS]
    right = [r for _, r in COLUMNS]
    return (
        "## Automatic planner vs hand-written and KerasHub layouts\n\n"
        f"Generated {datetime.date.today().isoformat()} on "
        f"{machine_description()}; {versions()}. 8 simulated host devices, "
        f"mesh `data x model`; {timed_steps} timed training steps per case. "
        "Models: the KerasHub backbones of `keras_autoshard/testing/zoo.py` "
        f"(2 layers, hidden 256, batch {zoo.BATCH} × seq {zoo.SEQ}, MSE on "
        "random targets; Llama has 2 KV heads, OPT a vocabulary of 1003). "
        "Regenerate with:\n\n"
        f"```\n{command}\n```\n\n"
        + markdown_table(headers, table_rows, right)
        + _skipped_notes(rows)
        + "\n\n"
        + HOW_TO_READ
        + "\n"
    )


HOW_TO_READ = """\
**How to read.** *auto* is the per-device operand bytes of every collective \
in the optimized HLO of one compiled training step under \
`AutoShardDistribution` (no budget); the next three columns divide it by the \
same figure for the hand-written Megatron plan, for the backbone's own \
`get_layout_map` (n/a: the class has none), and by the Megatron minimum (per \
layer 2 + 2 all-reduces of (b/data)·s·h·4 bytes over the model axis, plus \
the gradient all-reduce over the data axis; on the 8x1 mesh only the \
gradient all-reduce, which the auto plan goes below on 8x1 by cutting the \
token-embedding table over the data axis along its hidden dim: XLA then \
moves the lookup's activations, two all-to-alls of (b/data)·s·h, instead of \
all-reducing the table's gradient). *auto params ÷ ideal* is the per-device parameter \
bytes over (all parameter bytes ÷ 8). *auto_budget* is the collective bytes \
under a whole-peak budget that leaves the state 1.05 × (parameters + Adam \
moments) ÷ 8 per device (the free plan's estimated peak with its own \
parameters and optimizer state replaced by that share); *budget \
state/device* is its measured parameter + optimizer bytes per device (from \
the arrays' addressable shards) against that share (the budget is on the \
whole peak, so a plan may keep more state than the share where it saves \
as much elsewhere, for instance by rematerializing), and the \
second *÷ KerasHub map* compares its collective bytes to the KerasHub map. \
Under the budget the planner pins the output of a layer whose \
parameters it cuts for storage only (lookup and position tables), so XLA \
gathers once instead of carrying the cut through the residual stream, \
except where a norm scale or bias cut for storage over the same axis makes \
XLA hold the stream cut over it anyway (a pin would gather the output only \
for it to be cut again). On \
the 8x1 mesh the budget leaves one plan, every matrix FSDP-cut over the \
data axis and the table cut along its hidden dim, which is what KerasHub's \
map writes there: the same collectives, byte for byte. \
Step ratios divide the median `train_on_batch` wall time by the \
single-device run in the same process; with 8 devices simulated on 2 CPU \
cores they are noisy and not a forecast for accelerators."""


def _table_row(row: ZooRow) -> list[str]:
    auto = row.measured("auto")
    budget = row.measured("auto_budget")
    handwritten = row.measured("handwritten")
    hub = row.measured("keras_hub_map")
    single = row.measured("single")
    if auto is None:
        return [row.model, row.mesh] + ["n/a"] * (len(COLUMNS) - 2)
    ideal = auto.total_parameter_bytes / DEVICE_COUNT
    budget_bytes = BUDGET_FACTOR * ADAM_COPIES * auto.total_parameter_bytes / 8
    return [
        row.model,
        row.mesh,
        format_bytes(auto.collective_bytes),
        _ratio(auto.collective_bytes, handwritten),
        _ratio(auto.collective_bytes, hub),
        _plain_ratio(auto.collective_bytes, row.minimum.total_bytes),
        f"{auto.parameter_bytes_per_device / ideal:.2f}",
        format_bytes(budget.collective_bytes) if budget else "n/a",
        (
            f"{format_bytes(_state_bytes(budget))} vs {format_bytes(budget_bytes)}"
            if budget
            else "n/a"
        ),
        _ratio(budget.collective_bytes, hub) if budget else "n/a",
        _step_ratio(auto, single),
        _step_ratio(handwritten, single),
    ]


def _skipped_notes(rows: Sequence[ZooRow]) -> str:
    """Why a strategy has no figures (a missing `get_layout_map` excepted)."""
    notes = [
        f"- {row.model} {row.mesh} {strategy}: {result.reason}"
        for row in rows
        for strategy, result in row.results.items()
        if not isinstance(result, Measurement)
        and "has no get_layout_map" not in result.reason
    ]
    return "\n\nNot measured:\n\n" + "\n".join(notes) if notes else ""


def _state_bytes(result: Measurement) -> int:
    return result.parameter_bytes_per_device + result.optimizer_bytes_per_device


def _ratio(value: int, baseline: Measurement | None) -> str:
    if baseline is None:
        return "n/a"
    return _plain_ratio(value, baseline.collective_bytes)


def _plain_ratio(value: int, baseline: int) -> str:
    if baseline == 0:
        return "—" if value == 0 else "∞"
    return f"{value / baseline:.2f}"


def _step_ratio(result: Measurement | None, single: Measurement | None) -> str:
    if result is None or single is None:
        return "n/a"
    return f"{result.median_step_seconds / single.median_step_seconds:.2f}"


def write_json(path: str, rows: Sequence[ZooRow]) -> None:
    """Exact byte counts of every case, as JSON."""
    records = []
    for row in rows:
        for strategy, result in row.results.items():
            record = {"model": row.model, "mesh": row.mesh, "strategy": strategy}
            if isinstance(result, Measurement):
                record.update(
                    collective_bytes=result.collective_bytes,
                    collective_count=result.collective_count,
                    parameter_bytes_per_device=result.parameter_bytes_per_device,
                    optimizer_bytes_per_device=result.optimizer_bytes_per_device,
                    total_parameter_bytes=result.total_parameter_bytes,
                    step_seconds=list(result.step_seconds),
                )
            else:
                record["skipped"] = result.reason
            records.append(record)
        records.append(
            {
                "model": row.model,
                "mesh": row.mesh,
                "megatron_minimum": {
                    "activation_bytes": row.minimum.activation_bytes,
                    "gradient_bytes": row.minimum.gradient_bytes,
                },
            }
        )
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=2)
        f.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and update the output file; returns an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.planner_zoo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default="BENCHMARKS.md")
    parser.add_argument(
        "--models", nargs="+", choices=MODEL_NAMES, default=list(MODEL_NAMES)
    )
    parser.add_argument(
        "--meshes", nargs="+", choices=list(MESHES), default=list(MESHES)
    )
    parser.add_argument("--json", help="also write the raw results (exact bytes)")
    args = parser.parse_args(argv)
    timed_steps = QUICK_TIMED_STEPS if args.quick else TIMED_STEPS
    rows = run(args.models, args.meshes, timed_steps)
    command = shlex.join(["python", "-m", "benchmarks.planner_zoo", *argv])
    section = render(rows, timed_steps, command)
    write_section(args.output, SECTION_NAME, section)
    if args.json:
        write_json(args.json, rows)
    Console().print(section, markup=False, highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
