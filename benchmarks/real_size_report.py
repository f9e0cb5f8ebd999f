"""The real-size XLA:GPU section: a row's figures from its measurements,
and the Markdown.

`summarize` turns what `benchmarks.real_size_gpu` measured for one row (the
full plan's estimate, the compiles at a few depths and, where run, at the
full depth) into the row's figures; `render` writes the section. Every
figure is computed from the measurements; the published throughputs come
with the rows, each with its source.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
from collections.abc import Sequence
from typing import Any

from keras_autoshard.plans.hardware import hardware_profile
from keras_autoshard.plans.units import format_bytes
from keras_autoshard.testing.markdown import markdown_table
from keras_autoshard.testing.real_size_models import tokens_per_s_per_gpu
from keras_autoshard.testing.reduced_depth import fit_linear


def summarize(row, measured: dict[str, Any], target: str) -> dict[str, Any]:
    """A row's figures: the full depth's estimate and compiled peak
    (measured, or extrapolated from the fit over the compiled depths), the
    fits, and the throughput against the published one.

    Args:
        row: The `RealSizeRow`.
        measured: What `measure_row` returned for it.
        target: The hardware profile compiled for.

    Returns:
        Plain data (JSON-ready).
    """
    usable = hardware_profile(target).memory_budget_bytes
    estimate = measured["estimate"]
    compiles = measured["compiles"]
    full = measured.get("full_compile")
    summary: dict[str, Any] = {
        "estimated_peak_bytes": estimate["peak_bytes"],
        "usable_bytes": usable,
        "compiled_fit": None,
        "estimated_fit": None,
    }
    if len(compiles) >= 2:
        depths = [c["layers"] for c in compiles]
        compiled_fit = fit_linear(depths, [c["compiled_peak_bytes"] for c in compiles])
        estimated_fit = fit_linear(
            depths, [c["estimated_peak_bytes"] for c in compiles]
        )
        summary["compiled_fit"] = dataclasses.asdict(compiled_fit)
        summary["estimated_fit"] = dataclasses.asdict(estimated_fit)
        summary["extrapolated_compiled_bytes"] = compiled_fit.at(row.num_layers)
        summary["extrapolated_estimate_bytes"] = estimated_fit.at(row.num_layers)
    if full is not None:
        compiled, how = full["compiled_peak_bytes"], "measured"
    elif summary["compiled_fit"] is not None:
        compiled, how = summary["extrapolated_compiled_bytes"], "extrapolated"
    else:
        compiled, how = None, "none"
    summary["compiled_peak_bytes"] = compiled
    summary["compiled_how"] = how
    summary["ratio"] = None if compiled is None else estimate["peak_bytes"] / compiled
    summary["fits"] = None if compiled is None else compiled <= usable
    processes = [measured["planning_rss_bytes"]] + [c["rss_bytes"] for c in compiles]
    if full is not None:
        processes.append(full["rss_bytes"])
    summary["peak_rss_bytes"] = max(processes)
    step_time_s = estimate["step_time_s"]
    rate = tokens_per_s_per_gpu(row.batch, row.seq, step_time_s, row.device_count)
    summary["step_time_s"] = step_time_s
    summary["tokens_per_s_per_gpu"] = rate
    if row.published is not None:
        low, high = row.published.tokens_per_s_per_gpu
        summary["published_ratio"] = (rate / high, rate / low)
    return summary


def _bytes(num_bytes: float | None) -> str:
    return "—" if num_bytes is None else format_bytes(num_bytes)


def _range(values: Sequence[float], digits: int) -> str:
    low, high = sorted(values)
    low_text, high_text = f"{low:,.{digits}f}", f"{high:,.{digits}f}"
    return low_text if low_text == high_text else f"{low_text}–{high_text}"


def _mesh(row) -> str:
    return f"{row.mesh[0]}x{row.mesh[1]}"


def _levers(measured: dict[str, Any], num_layers: int) -> str:
    parts = []
    if measured["rematerialized"]:
        parts.append(f"remat {measured['rematerialized']} of {num_layers} layers")
    if measured["accumulation"] > 1:
        parts.append(f"accumulate {measured['accumulation']}")
    return ", ".join(parts) or "none"


def _full_compile_text(measured: dict[str, Any]) -> str:
    full = measured.get("full_compile")
    return "not run" if full is None else f"{full['compile_s']:.0f} s"


def _lever_mix_notes(rows, results) -> list[str]:
    """Rows whose compiled depths rematerialize another share of their
    layers than the full plan: their line is for those depths' levers."""
    notes = []
    for row, measured in zip(rows, results):
        compiles = measured["compiles"]
        full_share = measured["rematerialized"] / row.num_layers
        shares = {c["rematerialized"] / c["layers"] for c in compiles}
        if compiles and shares != {full_share}:
            depths = ", ".join(str(c["layers"]) for c in compiles)
            notes.append(
                f"{row.name} {_mesh(row)}: the full plan rematerializes "
                f"{measured['rematerialized']} of {row.num_layers} layers, the "
                f"compiled depths ({depths}) "
                + ("all of theirs" if shares == {1.0} else "another share")
                + ", so the line extrapolates their levers, not the full plan's"
            )
    return notes


def full_depth_table(rows, results, summaries) -> str:
    """One line per row: the full depth's estimate against XLA:GPU."""
    lines = []
    for row, measured, summary in zip(rows, results, summaries):
        compiled = _bytes(summary["compiled_peak_bytes"])
        if summary["compiled_how"] == "extrapolated":
            depths = ", ".join(str(c["layers"]) for c in measured["compiles"])
            compiled += f" (extrapolated from {depths} layers)"
        growth = "—"
        if summary["compiled_fit"] is not None:
            fit = summary["compiled_fit"]
            growth = (
                f"{_bytes(fit['per_layer'])} "
                f"(±{100 * fit['max_relative_residual']:.2f} %)"
            )
        lines.append(
            [
                row.name,
                _mesh(row),
                f"{row.batch} × {row.seq}",
                str(row.num_layers),
                f"{measured['planning_s']:.1f} s",
                _levers(measured, row.num_layers),
                _bytes(summary["estimated_peak_bytes"]),
                compiled,
                "—" if summary["ratio"] is None else f"{summary['ratio']:.2f}",
                {True: "yes", False: "NO", None: "—"}[summary["fits"]],
                _full_compile_text(measured),
                _bytes(summary["peak_rss_bytes"]),
                growth,
            ]
        )
    usable = _bytes(summaries[0]["usable_bytes"]) if summaries else ""
    return markdown_table(
        [
            "model", "mesh", "batch × tokens", "layers", "planned in", "levers",
            "estimated peak", "XLA:GPU compiled peak", "estimate / compiled",
            f"fits ({usable})", "compile, all layers", "peak RSS",
            "compiled per layer (fit residual)",
        ],
        lines,
        [False, False, True, True, True, False, True, True, True, False, True,
         True, True],
    )  # fmt: skip


def per_depth_table(rows, results, summaries) -> str:
    """One line per compiled depth, then the full depth: the fit's
    (labelled extrapolated) and the full plan's."""
    lines = []
    for row, measured, summary in zip(rows, results, summaries):
        for c in measured["compiles"]:
            lines.append(
                [
                    row.name, _mesh(row), str(c["layers"]),
                    _bytes(c["estimated_peak_bytes"]), _bytes(c["compiled_peak_bytes"]),
                    f"{c['estimated_peak_bytes'] / c['compiled_peak_bytes']:.2f}",
                    f"{c['compile_s']:.1f} s", _bytes(c["rss_bytes"]),
                ]
            )  # fmt: skip
        if summary["compiled_fit"] is not None:
            estimate = summary["extrapolated_estimate_bytes"]
            compiled = summary["extrapolated_compiled_bytes"]
            lines.append(
                [
                    row.name, _mesh(row),
                    f"{row.num_layers}, extrapolated (a + b × layers)",
                    _bytes(estimate), _bytes(compiled), f"{estimate / compiled:.2f}",
                    "—", "—",
                ]
            )  # fmt: skip
        full = measured.get("full_compile")
        estimate = summary["estimated_peak_bytes"]
        if full is None:
            compiled_cells = ["not compiled", "—", "—", "—"]
        else:
            compiled_cells = [
                _bytes(full["compiled_peak_bytes"]),
                f"{estimate / full['compiled_peak_bytes']:.2f}",
                f"{full['compile_s']:.1f} s",
                _bytes(full["rss_bytes"]),
            ]
        lines.append(
            [row.name, _mesh(row), f"{row.num_layers}, full plan", _bytes(estimate)]
            + compiled_cells
        )
    return markdown_table(
        ["model", "mesh", "layers", "estimated peak", "compiled peak",
         "estimate / compiled", "compile", "RSS"],
        lines,
        [False, False, False, True, True, True, True, True],
    )  # fmt: skip


def throughput_table(rows, summaries) -> str:
    """The estimated tokens/s per GPU against the published figure."""
    lines = []
    for row, summary in zip(rows, summaries):
        published = row.published
        lines.append(
            [
                row.name,
                f"{_mesh(row)} ({row.device_count} GPUs)",
                f"{summary['step_time_s']:.2f} s",
                f"{row.batch * row.seq:,}",
                f"{summary['tokens_per_s_per_gpu']:,.0f}",
                "—" if published is None else _range(published.tokens_per_s_per_gpu, 0),
                "—" if published is None else _range(summary["published_ratio"], 2),
                "—" if published is None else published.configuration,
            ]
        )
    return markdown_table(
        [
            "model", "mesh", "estimated step time", "tokens / step",
            "estimated tokens/s/GPU", "published tokens/s/GPU",
            "estimated / published", "published run",
        ],
        lines,
        [False, False, True, True, True, True, True, False],
    )  # fmt: skip


def render(
    rows,
    results: Sequence[dict[str, Any]],
    environment: str,
    command: str,
    target: str,
    full_compile_timeout_s: float,
    full_compile_rss_limit_bytes: int,
    not_planned: Sequence[str] = (),
) -> str:
    """The section: how the figures were made, then the three tables.

    Args:
        rows: The `RealSizeRow`s measured.
        results: What `measure_row` returned for each.
        environment: This machine and the versions used.
        command: The command that regenerates the section.
        target: The hardware profile compiled for.
        full_compile_timeout_s: Time given to a full-depth compile's
            process.
        full_compile_rss_limit_bytes: Largest fitted RSS of one that is
            run.
        not_planned: Rows that could not be planned, with why.

    Returns:
        The section's Markdown.
    """
    summaries = [summarize(row, result, target) for row, result in zip(rows, results)]
    profile = hardware_profile(target)
    usable = _bytes(profile.memory_budget_bytes)
    peak_tflops = profile.peak_bf16_flops / 1e12
    depths = sorted({c["layers"] for result in results for c in result["compiles"]})
    sources = sorted({row.published.source for row in rows if row.published})
    problems = list(not_planned) + [
        f"{row.name} {_mesh(row)}: {note}"
        for row, result in zip(rows, results)
        for note in result["skipped"]
    ]
    text = [
        f"## Real-size memory truth on XLA:GPU ({target}, `mixed_bfloat16`)",
        "",
        f"{environment}. Each model is planned at its full depth, shapes only, "
        f"under the {target} profile (its usable memory, {usable}, is the "
        "budget), KerasHub's backbone under `mixed_bfloat16`. Its Keras train "
        "step (Adam, MSE against the backbone's output shape, the plan's "
        "rematerialized layers and micro-batches) is then compiled by XLA:GPU "
        "for the mesh's GPUs ahead of time, with no GPU and no weight "
        "allocated (`compile_for_target`: jax's CUDA plugin over a topology "
        "of GPUs described by `runtime/gpu_targets/nvidia_h100_80gb.textproto`, "
        "written from NVIDIA's figures on the H200's description read from a "
        "device; XLA:GPU's default options). *Compiled peak*: arguments + "
        "outputs + temporaries − aliased, per device; *estimated peak*: "
        f"`plan.estimate.peak_bytes`; *fits*: the compiled peak within {usable}. "
        "Planning and each compile run in a process of their own, one at a "
        "time; *peak RSS* is the largest of a row's processes (`VmHWM`).",
        "",
        f"Depth: each row is also compiled at {', '.join(map(str, depths))} "
        "layers of the same widths, sharded as the full plan says (its spec "
        "for every variable, its rematerialized layers among those present, "
        "its micro-batches); the estimate at those depths is the planner's "
        "for that same sharding (every variable pinned; a variable the "
        "planner then stores otherwise is listed below). The compiled peak "
        "is fitted as a + b × layers by least squares (*per layer* is b; the "
        "residual is the largest relative one) "
        "and extrapolated to the full depth. All layers are compiled too, "
        f"in a process given {full_compile_timeout_s / 60:.0f} minutes, unless "
        "the fit of the RSS at the compiled depths says over "
        f"{_bytes(full_compile_rss_limit_bytes)}; the first table gives that "
        "compile's peak, or the fit's, marked *extrapolated*.",
        "",
        "Throughput: tokens/s per GPU = tokens of the global batch ÷ "
        "(estimated step time × GPUs). The estimated step time is one "
        "optimizer step over the whole global batch (the planner traces the "
        "global batch, so its FLOPs are all micro-batches' together, and it "
        "counts the data-axis reductions once per micro-batch): compute at "
        f"the profile's dense BF16 peak ({peak_tflops:.0f} TFLOP/s) plus each "
        "axis's collectives at its "
        "bandwidth, no overlap. It is not tuned to the published runs "
        f"({'; '.join(sources)}), which differ from these rows where the "
        "last column says, so the ratio says how far the step-time model is "
        "from measured training, no more. An image's tokens are its patches.",
        "",
        "Regenerate with:",
        "",
        "```",
        command,
        "```",
        "",
        full_depth_table(rows, results, summaries),
        "",
        "Per depth:",
        "",
        per_depth_table(rows, results, summaries),
        "",
        "Estimated throughput against published training runs:",
        "",
        throughput_table(rows, summaries),
    ]
    differing = [
        f"{row.name} {_mesh(row)}, {c['layers']} layers: "
        + "; ".join(c["estimate_plan_differences"])
        for row, result in zip(rows, results)
        for c in result["compiles"]
        if c.get("estimate_plan_differences")
    ]
    mixed = _lever_mix_notes(rows, results)
    if mixed:
        text += ["", "Levers at the compiled depths:", ""] + [f"- {n}" for n in mixed]
    if differing:
        text += [
            "",
            "Where the planner, its variables pinned, stored a variable cut "
            "otherwise than the full plan (a pin fixes a storage cut on its "
            "axes, the search may add one on another), the estimate at that "
            "depth is for its plan; the compile is the full plan's:",
            "",
        ] + [f"- {line}" for line in differing]
    if problems:
        text += ["", "Not measured:", ""] + [f"- {p}" for p in problems]
    return "\n".join(text)


def environment_description() -> str:
    """This machine and the versions that shape the figures."""
    from benchmarks.report import machine_description

    versions = []
    for name in ("jax", "jaxlib", "jax-cuda12-plugin", "keras", "keras-hub"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{machine_description()}; Python {platform.python_version()}, " + ", ".join(
        versions
    )
