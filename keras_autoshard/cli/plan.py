"""The `plan` and `inspect` commands.

`plan` builds the model abstractly (no weights), plans it and prints the
plan, its totals per device and the estimated communication per step; it
needs no devices, so any mesh can be planned on one machine. `inspect` also
builds the model for real under the plan, compiles one training step and
prints the compiled-program report next to the planner's estimate; with
`--target`, it builds the model abstractly again and XLA:GPU compiles the
step for the target's GPUs (no device, no weights).
"""

from __future__ import annotations

import argparse
import json
import logging

from rich.console import Console
from rich.table import Table

from keras_autoshard.cli.model_sources import (
    ModelSource,
    builder_source,
    hub_source,
    keras_file_source,
    load_json_config,
    mesh_from_args,
    sample_batch,
    sample_targets,
)
from keras_autoshard.errors import PlanError
from keras_autoshard.plans.plan_table import build_plan_table
from keras_autoshard.plans.units import format_bytes

logger = logging.getLogger(__name__)


def model_source(args: argparse.Namespace) -> ModelSource:
    """The `ModelSource` the command-line options name."""
    config = load_json_config(args.config)
    if args.hub:
        return hub_source(args.hub, config)
    if args.builder:
        return builder_source(args.builder, config)
    return keras_file_source(args.keras_file)


# --sequence-parallel's values, as `plan(sequence_parallel=...)` takes them.
SEQUENCE_PARALLEL = {"on": True, "off": False, "auto": "auto"}


def make_plan(args: argparse.Namespace, source: ModelSource):
    """Plan the model as the options ask; returns `(PlanningResult, sample,
    abstract model)`."""
    from keras_autoshard.planner.plan_request import PlanRequest
    from keras_autoshard.planner.planner import plan_with_cost
    from keras_autoshard.trace.tracer import build_abstract

    model = build_abstract(source.build)
    sample = sample_batch(model, args.batch, args.seq_len, args.input_shape)
    mesh = mesh_from_args(args.mesh, args.axis_names)
    request = PlanRequest(
        memory_budget=args.memory_budget,
        rules=dict(args.rule) if args.rule else None,
        device_count=args.devices,
        progress=True,
        hardware=getattr(args, "hardware", None),
        job=getattr(args, "job", "train"),
        rematerialize=getattr(args, "rematerialize", "auto"),
        sequence_parallel=SEQUENCE_PARALLEL[getattr(args, "sequence_parallel", "off")],
    )
    result = plan_with_cost(model, mesh, sample, request)
    return result, sample, model


def run_plan(args: argparse.Namespace) -> int:
    """`keras-autoshard plan`: print (and save) the plan; returns an exit code."""
    source = model_source(args)
    result, _, _ = make_plan(args, source)
    plan = result.plan
    console = Console(width=args.width)
    console.print(build_plan_table(plan, max_rows=args.max_rows))
    console.print(_totals_table(result))
    for note in plan.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    if args.json:
        plan.save(args.json)
        console.print(f"Wrote the plan to {args.json}", markup=False, highlight=False)
    if args.png:
        from keras_autoshard.report.plan_figure import save_plan_figure

        save_plan_figure(plan, args.png)
        console.print(f"Wrote the picture to {args.png}", markup=False, highlight=False)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    """`keras-autoshard inspect`: compile one step under the plan and compare.

    Returns:
        0, or 1 with `--strict` when an estimate differs by more than the
        tolerance.
    """
    from keras_autoshard import PlanDistribution, load_weights_sharded
    from keras_autoshard.apply.as_planned import compiler_options_for
    from keras_autoshard.report.estimate_check import (
        check_estimates,
        planner_estimates,
    )
    from keras_autoshard.testing.compiled import compiled_as_planned

    if args.job == "generate":
        raise PlanError(
            "inspect compiles Keras's train and predict steps; --job generate "
            "plans a generation step, which a KerasHub CausalLM has and the "
            "command line's backbones do not. Inspect --job inference here; "
            "the generate estimate is checked against a compiled CausalLM "
            "generate_step by `python -m benchmarks.generate_cache`."
        )
    if args.target:
        return _inspect_for_target(args)
    source = model_source(args)
    result, sample, abstract_model = make_plan(args, source)
    targets = sample_targets(abstract_model, sample)

    def build():
        model = source.build()
        if source.weights_path:
            load_weights_sharded(model, source.weights_path, progress=True)
        return model

    options = compiler_options_for(result.plan)
    # Its rematerialized layers and micro-batches, which its estimate counts.
    report = compiled_as_planned(
        result.plan,
        build,
        sample,
        targets,
        compiler_options=options,
        with_forward_step=True,
        # Every device: a mesh that leaves some out is an error here.
        distribution=PlanDistribution(result.plan),
    )
    console = Console(width=args.width)
    _print_header(
        console,
        result,
        source,
        "compiled one train step and one forward step"
        + _as_planned_note(result.plan, options is not None),
    )
    console.print(report.table(), markup=False, highlight=False)
    checks = check_estimates(
        planner_estimates(result.cost, result.plan.estimate),
        report,
        tolerance=args.tolerance,
    )
    flagged = _print_checks(console, checks, args.tolerance, on_cpu=True)
    if args.json:
        _write_json(console, args.json, report.to_dict(), checks)
    return 1 if flagged and args.strict else 0


def _inspect_for_target(args: argparse.Namespace) -> int:
    """`inspect --target`: the plan's train step compiled by XLA:GPU for the
    target's GPUs, from the model built abstractly (no device, no weights)."""
    from keras_autoshard.apply.jax.target_compile import compile_for_target
    from keras_autoshard.report.estimate_check import (
        check_train_step,
        planner_estimates,
    )
    from keras_autoshard.runtime.gpu_targets import require_gpu_compiler

    require_gpu_compiler()  # before planning, which can take a while
    source = model_source(args)
    result, sample, abstract_model = make_plan(args, source)
    targets = sample_targets(abstract_model, sample, shapes_only=True)
    compiled = compile_for_target(
        source.build, result.plan, (sample, targets), args.target
    )
    console = Console(width=args.width)
    weights_note = (
        "; the file's weights are not read (shapes only)" if source.weights_path else ""
    )
    _print_header(
        console,
        result,
        source,
        "compiled one train step"
        + _as_planned_note(result.plan, memory_scheduled=False)
        + weights_note,
    )
    console.print(compiled.table(), markup=False, highlight=False)
    checks = check_train_step(
        planner_estimates(result.cost, result.plan.estimate),
        compiled.step,
        {
            "parameters": compiled.parameter_bytes_per_device,
            "optimizer state": compiled.optimizer_bytes_per_device,
        },
        tolerance=args.tolerance,
    )
    flagged = _print_checks(console, checks, args.tolerance, on_cpu=False)
    if args.json:
        _write_json(console, args.json, compiled.to_dict(), checks)
    return 1 if flagged and args.strict else 0


def _print_header(console: Console, result, source: ModelSource, compiled: str):
    console.print(
        f"Planned {source.description} on mesh {result.plan.mesh.describe()} "
        f"in {result.planning_time_s:.1f} s; {compiled}.",
        markup=False,
        highlight=False,
        soft_wrap=True,  # one line: a long path stays whole
    )


def _print_checks(console: Console, checks, tolerance: float, on_cpu: bool) -> list:
    """The estimate table and a line saying what differs; returns the
    flagged quantities."""
    from keras_autoshard.report.estimate_check import estimate_table

    console.print(estimate_table(checks))
    flagged = [check.quantity for check in checks if check.flagged]
    if flagged:
        console.print(
            f"{len(flagged)} estimate(s) differ from the compiled program by more "
            f"than {tolerance:.0%}: {', '.join(flagged)}.",
            markup=False,
            highlight=False,
        )
        if on_cpu and any("communication" in quantity for quantity in flagged):
            console.print(
                "XLA:CPU forms no reduce-scatter and combines fewer all-reduces, "
                "so its communication is an upper bound for GPU/TPU."
            )
    else:
        console.print(
            f"Every estimate is within {tolerance:.0%} of the compiled program."
        )
    return flagged


def _write_json(console: Console, path: str, report: dict, checks) -> None:
    report = {**report, "estimate_checks": [check.to_dict() for check in checks]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    console.print(f"Wrote the report to {path}", markup=False, highlight=False)


def _as_planned_note(sharding_plan, memory_scheduled: bool) -> str:
    """How the compiled step follows the plan's levers, for the header."""
    parts = []
    if sharding_plan.rematerialize:
        parts.append(f"{len(sharding_plan.rematerialize)} layer(s) rematerialized")
    if memory_scheduled:
        parts.append(
            "scheduled for memory as accelerators are (XLA:CPU's defaults "
            "order for throughput and merge a recomputation away)"
        )
    if sharding_plan.gradient_accumulation_steps > 1:
        parts.append(
            f"one of {sharding_plan.gradient_accumulation_steps} micro-batches"
        )
    return f" ({'; '.join(parts)})" if parts else ""


def _totals_table(result) -> Table:
    plan, cost = result.plan, result.cost
    table = Table(title="Per device (planner estimate)")
    table.add_column("quantity")
    table.add_column("bytes", justify="right")
    rows = [
        ("variables (as planned)", plan.bytes_per_device()),
        ("variables, all devices together", plan.total_bytes()),
        *plan.estimate.lines(),
    ]
    if plan.estimate.budget_bytes is not None:
        rows.append(("memory budget", plan.estimate.budget_bytes))
    rows += [
        ("communication per step", cost.communication_bytes),
    ]
    rows += [
        (f"  over {axis}", axis_bytes)
        for axis, axis_bytes in cost.communication_by_axis.items()
    ]
    for name, value in rows:
        table.add_row(name, format_bytes(value))
    estimate = plan.estimate
    table.add_row("compute per step", f"{estimate.compute_flops / 1e12:,.1f} TFLOP")
    if estimate.step_time_s is not None:
        table.add_row(
            f"step time on {estimate.hardware}", f"{estimate.step_time_s:,.2f} s"
        )
    table.caption = f"planned in {result.planning_time_s:.1f} s"
    return table
