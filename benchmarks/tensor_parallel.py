"""`TensorParallel` against the unwrapped model, at world sizes 2, 4 and 8.

Run from the repository root:

```
python -m benchmarks.tensor_parallel [--quick] [--output BENCHMARKS.md]
    [--models bert gpt2] [--world-sizes 2 4 8]
```

For each model (KerasHub BERT and GPT-2 backbones from small configs) and
world size, the model is wrapped in `TensorParallel` on 8 simulated host
devices (mesh `(8 // world_size, world_size)`), its compiled train step is
inspected, and `train_on_batch` is timed against the same model unwrapped on
one device. The table replaces the `tensor-parallel` section of the output
file (other sections are kept).
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
import datetime  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.measure import time_train_steps  # noqa: E402
from keras_autoshard import TensorParallel  # noqa: E402
from keras_autoshard.building import names_replayed_after  # noqa: E402
from keras_autoshard.errors import PlanError  # noqa: E402
from keras_autoshard.plans.estimate import HEADROOM  # noqa: E402
from keras_autoshard.plans.units import format_bytes  # noqa: E402
from keras_autoshard.report.estimate_check import compiled_peak_bytes  # noqa: E402
from keras_autoshard.testing.markdown import markdown_table, write_section  # noqa: E402

SECTION_NAME = "tensor-parallel"
BATCH, SEQ, VOCAB = 8, 64, 1024
WORLD_SIZES = (2, 4, 8)
TIMED_STEPS = 10
QUICK_TIMED_STEPS = 3
MODEL_AXIS = "model"
# Each world size is measured without a memory budget (the planner minimises
# communication) and with a budget of this share of that plan's estimated
# peak (a budget holds the whole peak: state, activations, transients).
BUDGET_SHARE = 0.8


def build_bert() -> keras.Model:
    import keras_hub

    return keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=8,
        hidden_dim=256,
        intermediate_dim=512,
        max_sequence_length=SEQ,
    )


def build_gpt2() -> keras.Model:
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=8,
        hidden_dim=256,
        intermediate_dim=1024,
        max_sequence_length=SEQ,
    )


def token_batch(segments: bool) -> tuple[dict[str, np.ndarray], Any]:
    """Random token ids (and segment ids), a full mask, and MSE targets."""
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32"),
        "padding_mask": np.ones((BATCH, SEQ), "int32"),
    }
    if segments:
        x["segment_ids"] = np.zeros((BATCH, SEQ), "int32")
        return x, {
            "sequence_output": rng.standard_normal((BATCH, SEQ, 256), "float32"),
            "pooled_output": rng.standard_normal((BATCH, 256), "float32"),
        }
    return x, rng.standard_normal((BATCH, SEQ, 256), "float32")


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A benchmark model: builder, one batch, a one-line description."""

    build: Callable[[], keras.Model]
    batch: Callable[[], tuple[Any, Any]]
    description: str


MODELS = {
    "bert": ModelCase(
        build_bert,
        lambda: token_batch(segments=True),
        "KerasHub BertBackbone: 2 layers, hidden 256, 8 heads, intermediate 512, "
        f"vocabulary {VOCAB}",
    ),
    "gpt2": ModelCase(
        build_gpt2,
        lambda: token_batch(segments=False),
        "KerasHub GPT2Backbone: 2 layers, hidden 256, 8 heads, intermediate 1024, "
        f"vocabulary {VOCAB}",
    ),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One (model, world size) measurement.

    Args:
        model: Model name.
        world_size: Devices per model copy (the `"model"` mesh axis).
        mesh: The mesh, described.
        memory_budget: Per-device bytes given to the planner, or `None`.
        estimated_peak: The plan's estimated peak bytes per device.
        compiled_peak: The compiled train step's peak bytes per device.
        state_bytes_per_device: Largest per-device parameter plus optimizer
            bytes, from the compiled report.
        total_state_bytes: Parameter plus optimizer bytes of the whole model.
        model_axis_all_reduces: All-reduces over the model axis in the
            compiled train step.
        collective_bytes: Per-device operand bytes of every collective in it.
        step_seconds: Timed `train_on_batch` wall times, wrapped.
        reference_step_seconds: The same, unwrapped on one device.
    """

    model: str
    world_size: int
    mesh: str
    memory_budget: int | None
    estimated_peak: int
    compiled_peak: int
    state_bytes_per_device: int
    total_state_bytes: int
    model_axis_all_reduces: int
    collective_bytes: int
    step_seconds: tuple[float, ...]
    reference_step_seconds: tuple[float, ...]

    @property
    def state_over_ideal(self) -> float:
        """Per-device state ÷ (whole state ÷ world size); 1.0 is ideal."""
        return self.state_bytes_per_device / (self.total_state_bytes / self.world_size)

    @property
    def step_ratio(self) -> float:
        return statistics.median(self.step_seconds) / statistics.median(
            self.reference_step_seconds
        )


@dataclasses.dataclass(frozen=True)
class NoFit:
    """A budget under which the planner found no plan (its error kept)."""

    model: str
    world_size: int
    mesh: str
    memory_budget: int
    error: str


def _variable_bytes(variables) -> int:
    unique = {id(v): v for v in variables}.values()
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in unique)


def _adam() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(1e-3)


def measure_reference(
    case: ModelCase, timed_steps: int
) -> tuple[tuple[float, ...], int]:
    """`train_on_batch` wall times of the unwrapped model on one device, and
    its parameter bytes."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    x, y = case.batch()
    model = case.build()
    model.compile(optimizer=_adam(), loss="mse")
    return time_train_steps(model, x, y, timed_steps), _variable_bytes(model.variables)


def measure(
    name: str,
    case: ModelCase,
    world_size: int,
    timed_steps: int,
    reference: tuple[float, ...],
    memory_budget: int | None = None,
) -> Row:
    """Wrap, inspect and time one model at one world size."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    x, y = case.batch()
    with names_replayed_after():
        model = TensorParallel(
            case.build,
            world_size=world_size,
            sample_input=x,
            memory_budget=memory_budget,
        )
    model.compile(optimizer=_adam(), loss="mse")
    report = model.inspect((x, y))
    total = _variable_bytes(model.variables) + _variable_bytes(
        model.optimizer.variables
    )
    state_by_device = [
        sum(column)
        for column in zip(
            *(v.bytes_by_device for v in report.parameters + report.optimizer_state)
        )
    ]
    return Row(
        model=name,
        world_size=world_size,
        mesh=model.setup.mesh.describe(),
        memory_budget=memory_budget,
        estimated_peak=model.plan.estimate.peak_bytes,
        compiled_peak=compiled_peak_bytes(report.train_step.memory),
        state_bytes_per_device=max(state_by_device),
        total_state_bytes=total,
        model_axis_all_reduces=report.train_step.count("all-reduce", (MODEL_AXIS,)),
        collective_bytes=report.train_step.operand_bytes(),
        step_seconds=time_train_steps(model, x, y, timed_steps),
        reference_step_seconds=reference,
    )


def render_section(
    rows: Sequence[Row], models: Sequence[str], timed_steps: int, command: str
) -> str:
    """The Markdown section: provenance, one table per model, notes."""
    lines = [
        "## TensorParallel vs the unwrapped model",
        "",
        f"Generated {datetime.date.today().isoformat()} on {platform.machine()} "
        f"({os.cpu_count()} CPUs), Python {platform.python_version()}, keras "
        f"{keras.__version__}; {DEVICE_COUNT} simulated host devices, mesh "
        "(8 / world_size) × world_size over (batch, model); batch "
        f"{BATCH} × seq {SEQ}, fp32, Adam, MSE; {timed_steps} timed steps. "
        "Regenerate with:",
        "",
        "```",
        command,
        "```",
        "",
        "*state ÷ ideal*: largest per-device parameter + optimizer bytes "
        "(read from the arrays' shards) ÷ (whole model's parameter + optimizer "
        "bytes ÷ world size); 1.00 means every byte is cut world-size ways, "
        "below 1.00 that a budget also cuts state over the batch axis "
        "(FSDP). "
        "*step ÷ unwrapped*: median `train_on_batch` time ÷ the unwrapped "
        "model's on one device. Simulated devices share the host's cores, so "
        "step ratios measure overhead, not speed-up. *memory budget*: none lets "
        "the planner minimise communication (it keeps embeddings and norms "
        "whole when there is no data axis); the second row of each world size "
        f"passes `memory_budget` = {BUDGET_SHARE} × the first plan's estimated "
        "peak to `TensorParallel` (a budget holds the whole peak per device: "
        "parameters, gradients, optimizer state, kept activations, "
        "transients, of which plans fill at most "
        f"{1 - HEADROOM['XLA:CPU']:.0%}), trading collectives for memory. "
        "*estimated peak*: `plan.estimate.peak_bytes`; *compiled peak*: the "
        "compiled train step's (XLA:CPU) arguments + outputs + temporaries − "
        "aliased, per device.",
    ]
    for name in models:
        lines += ["", f"### {name}", "", MODELS[name].description + ".", ""]
        table_rows = [_table_row(row) for row in rows if row.model == name]
        lines.append(
            markdown_table(
                [
                    "world size",
                    "mesh",
                    "memory budget",
                    "estimated peak",
                    "compiled peak",
                    "params+optimizer/device",
                    "whole model",
                    "state ÷ ideal",
                    "all-reduces (model axis)",
                    "collective bytes/device",
                    "median step (ms)",
                    "step ÷ unwrapped",
                ],
                table_rows,
                right_aligned=[True, False, True] + [True] * 9,
            )
        )
    return "\n".join(lines) + "\n"


def _table_row(row: Row | NoFit) -> list[str]:
    if isinstance(row, NoFit):
        reason = row.error.split(" (")[0].split(": ")[0]
        return [
            str(row.world_size),
            row.mesh,
            format_bytes(row.memory_budget),
            f"no plan: {reason}",
        ] + ["—"] * 8
    return [
        str(row.world_size),
        row.mesh,
        "none" if row.memory_budget is None else format_bytes(row.memory_budget),
        format_bytes(row.estimated_peak),
        format_bytes(row.compiled_peak),
        format_bytes(row.state_bytes_per_device),
        format_bytes(row.total_state_bytes),
        f"{row.state_over_ideal:.2f}",
        str(row.model_axis_all_reduces),
        format_bytes(row.collective_bytes),
        f"{1000 * statistics.median(row.step_seconds):.1f}",
        f"{row.step_ratio:.2f}",
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tensor_parallel",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"time {QUICK_TIMED_STEPS} steps instead of {TIMED_STEPS}",
    )
    parser.add_argument(
        "--output", default="BENCHMARKS.md", help="Markdown file to update"
    )
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=list(MODELS)
    )
    parser.add_argument(
        "--world-sizes",
        nargs="+",
        type=int,
        choices=WORLD_SIZES,
        default=list(WORLD_SIZES),
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the section and write it; returns an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    timed_steps = QUICK_TIMED_STEPS if args.quick else TIMED_STEPS
    rows = []
    for name in args.models:
        case = MODELS[name]
        reference, _ = measure_reference(case, timed_steps)
        for world_size in args.world_sizes:
            free = measure(name, case, world_size, timed_steps, reference)
            rows.append(free)
            budget = int(BUDGET_SHARE * free.estimated_peak)
            try:
                rows.append(
                    measure(name, case, world_size, timed_steps, reference, budget)
                )
            except PlanError as error:
                rows.append(NoFit(name, world_size, free.mesh, budget, str(error)))
    command = shlex.join(["python", "-m", "benchmarks.tensor_parallel", *argv])
    section = render_section(rows, args.models, timed_steps, command)
    write_section(args.output, SECTION_NAME, section)
    print(section)
    print(f"Wrote section {SECTION_NAME!r} of {args.output}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
