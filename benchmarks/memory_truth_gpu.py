"""Memory truth on XLA:GPU: the zoo's plans made for H100s, compiled for 8.

Run from the repository root (JAX's CUDA plugin installed: the
`gpu-compile` extra; no GPU needed):

```
python -m benchmarks.memory_truth_gpu [--output BENCHMARKS.md]
    [--models gpt2 ...] [--workers 2] [--json PATH]
```

1. Every row of `benchmarks.memory_truth`'s zoo table (`truth_settings`:
   budgets and `rematerialize="all"` on 2x4, 1x8 and 8x1, LoRA, the free
   plans on each mesh, `mixed_bfloat16` on 2x4) planned again for the GPU:
   the same model, batch, mesh, dtype policy and levers requested, with
   `hardware="h100-80gb"`, so the estimate is XLA:GPU's (a budget row's
   share is of the GPU plan's own peak without a budget). Each train step
   is compiled by XLA:GPU for 8 H100s, ahead of time, no weights allocated
   (`compile_for_target`, XLA:GPU's default options): estimated against
   compiled peak per device, and the step's collective operand bytes per
   device over each mesh axis.
2. Each KerasHub transformer of the zoo on 2x4 and 1x8: the planner's free
   GPU plan (its row of table 1) against the hand-written Megatron plan
   (`reference_rules.keras_hub_megatron_plan`) compiled the same way: the
   train step's collective operand bytes per device, every kind
   (reduce-scatters included), in total and per mesh axis.

Every figure is computed in this run; nothing is read from a file. The
compiles run in `--workers` processes. Rows replace the `memory-truth-gpu`
section of the output file.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Planning runs on the host; XLA:GPU compiles for a topology, not a device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

SECTION_NAME = "memory-truth-gpu"
TARGET = "h100-80gb"
DEVICE_COUNT = 8
COMMAND = "python -m benchmarks.memory_truth_gpu --output BENCHMARKS.md"
# Estimate over compiled peak counted as agreeing (the bound).
AGREE = 0.10
# The zoo's KerasHub transformers, with the hand-written Megatron rules.
MEGATRON_MODELS = ("bert", "gemma", "gpt2", "llama", "opt")
MEGATRON_MESHES = ((2, 4), (1, 8))
# Column order of the collective bytes: each mesh axis, both at once, and
# device groups that are no set of mesh axes (part of one).
AXIS_GROUPS = ("batch", "model", "batch+model", "other groups")


def selected_settings(models: Sequence[str] | None = None) -> list:
    """The zoo table's settings (`memory_truth.truth_settings`), those of
    `models` only when given (a LoRA row counts as its base model's)."""
    from benchmarks.memory_truth import truth_settings

    return [
        setting
        for setting in truth_settings()
        if models is None or setting.model.split()[0] in models
    ]


def collective_bytes_by_axes(step) -> dict[str, int]:
    """A compiled step's collective operand bytes per device, by the mesh
    axes each collective spans (`AXIS_GROUPS`), every kind together."""
    totals: dict[str, int] = {}
    for op in step.collectives:
        group = "+".join(op.mesh_axes) if op.mesh_axes else "other groups"
        totals[group] = totals.get(group, 0) + op.operand_bytes
    return totals


def collective_bytes_by_kind(step) -> dict[str, int]:
    """A compiled step's collective operand bytes per device, by kind."""
    totals: dict[str, int] = {}
    for op in step.collectives:
        totals[op.kind] = totals.get(op.kind, 0) + op.operand_bytes
    return totals


def layout_key(sharding_plan) -> str:
    """What of a plan shapes its compiled program: each variable's spec,
    the batch axis, activation layouts, rematerialized layers, micro-batches."""
    return json.dumps(
        {
            "specs": sorted((v.path, repr(v.spec)) for v in sharding_plan.variables),
            "batch_axis": sharding_plan.batch_axis,
            "activations": [repr(a) for a in sharding_plan.activations],
            "rematerialize": list(sharding_plan.rematerialize),
            "micro_batches": sharding_plan.gradient_accumulation_steps,
        },
        sort_keys=True,
    )


def _compiled(build, sharding_plan, x, target=TARGET) -> dict[str, Any]:
    """Compile one plan's train step for the target's GPUs: its figures."""
    from keras_autoshard import compile_for_target
    from keras_autoshard.report.estimate_check import compiled_io_bytes
    from keras_autoshard.testing import zoo

    y = zoo.random_targets(build, x)
    result = compile_for_target(build, sharding_plan, (x, y), target)
    memory = result.step.memory
    return {
        "compiled_peak": result.compiled_peak_bytes,
        "io_bytes": compiled_io_bytes(memory),
        "collectives_by_axes": collective_bytes_by_axes(result.step),
        "collectives_by_kind": collective_bytes_by_kind(result.step),
        "compile_s": result.compile_s,
    }


def compiled_peak_under_limit(
    build, sharding_plan, x, limit_bytes: int, io_bytes: int
) -> int:
    """The compiled peak of one plan's train step for `TARGET`'s GPUs with as
    much memory as makes XLA:GPU's limit for the program
    (`xla_gpu_program_limit` of its `io_bytes`, arguments and outputs)
    `limit_bytes`: what XLA:GPU needs where memory binds, rather than what
    it holds with 80 GB free (its latency-hiding schedule defers work, and
    holds its buffers, where memory allows)."""
    import dataclasses
    import pathlib
    import tempfile

    from keras_autoshard.plans.estimate import (
        XLA_GPU_MEMORY_SHARE,
        XLA_GPU_SLOP_FACTOR,
    )
    from keras_autoshard.plans.hardware import hardware_profile
    from keras_autoshard.runtime.gpu_targets import target_description

    profile = hardware_profile(TARGET)
    # limit = io + (share * memory - io) * slop, solved for memory.
    kept = limit_bytes - io_bytes * (1 - XLA_GPU_SLOP_FACTOR)
    memory = int(kept / (XLA_GPU_MEMORY_SHARE * XLA_GPU_SLOP_FACTOR))
    text = re.sub(
        r"device_memory_size: \d+",
        f"device_memory_size: {memory}",
        target_description(profile),
    )
    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory) / "target.textproto"
        path.write_text(text, encoding="utf-8")
        limited = dataclasses.replace(profile, gpu_target=str(path))
        return _compiled(build, sharding_plan, x, limited)["compiled_peak"]


def zoo_row(index: int, models: Sequence[str] | None = None) -> dict[str, Any]:
    """Plan the `index`-th selected setting for the GPU and compile it; a
    budget no plan fits gives a row with the planner's error instead."""
    from keras_autoshard.errors import PlanError
    from keras_autoshard.testing.markdown import short_levers

    setting = selected_settings(models)[index]
    row: dict[str, Any] = {
        "model": setting.model,
        "mesh": "x".join(map(str, setting.mesh_shape)),
        "policy": setting.policy,
        "dtype_policy": setting.dtype_policy,
        "rematerialize": setting.rematerialize,
        "budget_share": setting.budget_share,
    }
    with setting.scope():
        start = time.perf_counter()
        try:
            sharding_plan = setting.plan(hardware=TARGET)
        except PlanError as error:
            return {**row, "plan_error": str(error)}
        row["plan_s"] = time.perf_counter() - start
        row.update(_compiled(setting.build, sharding_plan, setting.x))
        estimate = sharding_plan.estimate.peak_bytes
        if estimate < (1 - AGREE) * row["compiled_peak"]:
            row["compiled_peak_at_estimate"] = compiled_peak_under_limit(
                setting.build, sharding_plan, setting.x, estimate, row["io_bytes"]
            )
    return {
        **row,
        "levers": short_levers(sharding_plan),
        "compiler": sharding_plan.estimate.compiler,
        "estimated_peak": sharding_plan.estimate.peak_bytes,
        "budget_bytes": sharding_plan.estimate.budget_bytes,
        "layout": layout_key(sharding_plan),
    }


def megatron_row(name: str, mesh_shape: tuple[int, int]) -> dict[str, Any]:
    """The hand-written Megatron plan of a zoo transformer compiled for the
    GPUs; not compiled where it is the planner's own layout (its free GPU
    plan, planned here again: the same plan as its zoo row)."""
    from keras_autoshard import MeshSpec, plan
    from keras_autoshard.testing import zoo
    from keras_autoshard.testing.reference_plans import keras_hub_megatron_plan
    from keras_autoshard.trace.tracer import build_abstract

    build, batch = zoo.ZOO[name]
    x = batch()
    mesh = MeshSpec(mesh_shape, ("batch", "model"))
    handwritten = keras_hub_megatron_plan(build_abstract(build), mesh)
    planner = plan(build, mesh, x, hardware=TARGET)
    row: dict[str, Any] = {
        "model": name,
        "mesh": f"{mesh_shape[0]}x{mesh_shape[1]}",
        "planner_layout": layout_key(planner),
        "same_layout": layout_key(handwritten) == layout_key(planner),
    }
    if not row["same_layout"]:
        row.update(_compiled(build, handwritten, x))
    return row


def _run_job(job: tuple) -> dict[str, Any]:
    """One job in a worker process: a zoo row or a hand-written plan."""
    import jax

    kind, *arguments = job
    row = zoo_row(*arguments) if kind == "zoo" else megatron_row(*arguments)
    jax.clear_caches()
    return row


def _job_label(job: tuple, settings: Sequence) -> str:
    if job[0] == "zoo":
        setting = settings[job[1]]
        mesh = "x".join(map(str, setting.mesh_shape))
        return f"{setting.model} {mesh} {setting.policy}"
    _, name, shape = job
    return f"{name} {shape[0]}x{shape[1]} hand-written Megatron"


def run_jobs(jobs: Sequence[tuple], workers: int, labels: Sequence[str]) -> list:
    """Every job's row, in the jobs' order; progress printed as each ends."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    start = time.perf_counter()
    results: list = [None] * len(jobs)

    def report(done: int, position: int) -> None:
        row = results[position]
        figures = ": no plan fits" if "plan_error" in row else ""
        if "compiled_peak" in row:
            figures = f": compiled {row['compiled_peak'] / 2**20:.2f} MiB"
            figures += f" in {row['compile_s']:.1f} s"
        print(
            f"[{done}/{len(jobs)} {time.perf_counter() - start:.0f} s] "
            f"{labels[position]}{figures}",
            flush=True,
        )

    if workers <= 1:
        for position, job in enumerate(jobs):
            results[position] = _run_job(job)
            report(position + 1, position)
        return results
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {pool.submit(_run_job, job): i for i, job in enumerate(jobs)}
        for done, future in enumerate(as_completed(futures), 1):
            results[futures[future]] = future.result()
            report(done, futures[future])
    return results


def _ratio(row: dict) -> float:
    return row["estimated_peak"] / row["compiled_peak"]


def _within(ratio: float) -> bool:
    return 1 - AGREE <= ratio <= 1 + AGREE


def _span(rows: Sequence[dict]) -> str:
    ratios = [_ratio(r) for r in rows]
    inside = sum(map(_within, ratios))
    return (
        f"{min(ratios):.2f} to {max(ratios):.2f} "
        f"({inside} of {len(ratios)} within ±{AGREE:.0%})"
    )


def _row_name(row: dict) -> str:
    return f"{row['model']} {row['mesh']} {row['policy']}"


def _row_group(row: dict) -> str:
    if "LoRA" in row["model"]:
        return "LoRA"
    if row["budget_share"] is not None or row["rematerialize"] != "auto":
        return "rematerializing"
    return f"free {row['dtype_policy']}"


def _axis_cells(totals: dict[str, int], groups: Sequence[str]) -> list[str]:
    from keras_autoshard.plans.units import format_bytes

    return [format_bytes(totals.get(group, 0)) for group in groups]


def _axis_groups(rows: Iterable[dict]) -> list[str]:
    """The `AXIS_GROUPS` some row has collectives over."""
    seen = {group for row in rows for group in row["collectives_by_axes"]}
    return [group for group in AXIS_GROUPS if group in seen]


def _unplanned_cells(row: dict) -> str:
    """The planner's error, to the least peak it found (the rest in the JSON)."""
    match = re.match(r"(.*?, over by \S+ \S+)", row["plan_error"])
    return match.group(1) if match else row["plan_error"]


def zoo_section(rows: Sequence[dict]) -> str:
    """Table 1 and its summary (Markdown)."""
    from keras_autoshard.plans.units import format_bytes
    from keras_autoshard.testing.markdown import markdown_table

    compiled = [r for r in rows if "plan_error" not in r]
    groups = _axis_groups(compiled)
    cells = []
    for r in rows:
        if "plan_error" in r:
            blank = ["—"] * (3 + len(groups))
            cells.append([r["model"], r["mesh"], r["policy"], "no plan"] + blank)
            continue
        cells.append(
            [r["model"], r["mesh"], r["policy"], r["levers"],
             format_bytes(r["estimated_peak"]), format_bytes(r["compiled_peak"]),
             f"{_ratio(r):.2f}"]
            + _axis_cells(r["collectives_by_axes"], groups)
        )  # fmt: skip
    table = markdown_table(
        ["model", "mesh", "policy", "levers", "estimated peak (XLA:GPU)",
         "XLA:GPU compiled peak", "ratio"]
        + [f"collectives over {group}" for group in groups],
        cells,
        right_aligned=[False] * 4 + [True] * (3 + len(groups)),
    )  # fmt: skip
    by_group: dict[str, list[dict]] = {}
    for row in compiled:
        by_group.setdefault(_row_group(row), []).append(row)
    outside = sorted(
        (r for r in compiled if not _within(_ratio(r))),
        key=lambda r: -abs(_ratio(r) - 1),
    )
    compilers = sorted({r["compiler"] for r in compiled})
    groups_text = "; ".join(
        f"{name} {_span(members)}" for name, members in by_group.items()
    )
    outside_text = "; ".join(f"{_row_name(r)} ({_ratio(r):.2f})" for r in outside)
    unplanned = "".join(
        f" {_row_name(r)}: {_unplanned_cells(r)}." for r in rows if "plan_error" in r
    )
    under = sum(_ratio(r) < 1 for r in compiled)
    limited = [r for r in compiled if "compiled_peak_at_estimate" in r]
    limited_text = "; ".join(
        f"{_row_name(r)} {r['estimated_peak'] / r['compiled_peak_at_estimate']:.2f}"
        for r in limited
    )
    budgeted = [r for r in compiled if r["budget_share"] is not None]
    budget_text = "; ".join(
        f"{_row_name(r)} {format_bytes(r['compiled_peak'])} of "
        f"{format_bytes(r['budget_bytes'])} "
        f"({r['compiled_peak'] / r['budget_bytes']:.2f})"
        for r in budgeted
    )
    if budgeted:
        over = [r for r in budgeted if r["compiled_peak"] > r["budget_bytes"]]
        budget_text = (
            f" Planned under a budget, compiled against it: {budget_text}; "
            f"{len(budgeted) - len(over)} of {len(budgeted)} compile within "
            "their budget."
        )
    if limited:
        limited_text = (
            " Compiled again with XLA:GPU's memory limit at the estimate (as for "
            "a GPU whose `xla_gpu_program_limit` is the estimate), "
            f"the rows estimated more than {AGREE:.0%} under: estimate over "
            f"compiled peak {limited_text}."
        )
    return (
        f"Estimate over compiled peak, {len(compiled)} rows compiled: "
        f"{_span(compiled)}; the estimate is under the compiled peak on {under} "
        f"of {len(compiled)} rows. By kind of row: {groups_text}. Outside "
        f"±{AGREE:.0%} (ratios before rounding), farthest first: "
        f"{outside_text or 'none'}.{limited_text}{budget_text} The estimates "
        f"are {' and '.join(compilers)}'s (the plans' `estimate.compiler`). "
        f"Rows the planner found no plan for: "
        f"{len(rows) - len(compiled)}.{unplanned}\n\n"
        f"{table}\n"
    )


def _pairs(zoo_rows: Sequence[dict], megatron_rows: Sequence[dict]) -> list:
    """Each hand-written row with the planner's zoo row it is set against
    (float32, no budget, same model and mesh)."""
    planner = {
        (r["model"], r["mesh"]): r for r in zoo_rows if _row_group(r) == "free float32"
    }
    pairs = []
    for row in megatron_rows:
        ours = planner[row["model"], row["mesh"]]
        if ours["layout"] != row["planner_layout"]:
            raise RuntimeError(
                f"{row['model']} {row['mesh']}: the planner's free GPU plan "
                "differs between its zoo row and the hand-written row's run"
            )
        pairs.append((ours, ours if row["same_layout"] else row))
    return pairs


def megatron_section(zoo_rows: Sequence[dict], megatron_rows: Sequence[dict]) -> str:
    """Table 2 and its summary (Markdown)."""
    from keras_autoshard.plans.units import format_bytes
    from keras_autoshard.testing.markdown import markdown_table

    pairs = _pairs(zoo_rows, megatron_rows)
    groups = _axis_groups(row for pair in pairs for row in pair)
    cells, ratios, above, same, at_most = [], [], [], [], 0
    for (ours, theirs), row in zip(pairs, megatron_rows):
        ours_total = sum(ours["collectives_by_axes"].values())
        theirs_total = sum(theirs["collectives_by_axes"].values())
        name = f"{row['model']} {row['mesh']}"
        ratio = "—"
        if theirs_total:
            ratios.append(ours_total / theirs_total)
            ratio = f"{ours_total / theirs_total:.2f}"
        at_most += ours_total <= theirs_total
        if row["same_layout"]:
            same.append(name)
        elif ours_total > theirs_total:
            above.append(f"{name} ({ratio})")
        cells.append(
            [row["model"], row["mesh"], "yes" if row["same_layout"] else "no"]
            + _axis_cells(ours["collectives_by_axes"], groups)
            + [format_bytes(ours_total)]
            + _axis_cells(theirs["collectives_by_axes"], groups)
            + [format_bytes(theirs_total), ratio,
               format_bytes(ours["compiled_peak"]),
               format_bytes(theirs["compiled_peak"])]
        )  # fmt: skip
    table = markdown_table(
        ["model", "mesh", "same layout"]
        + [f"planner: {group}" for group in groups] + ["planner: total"]
        + [f"hand-written: {group}" for group in groups]
        + ["hand-written: total", "planner / hand-written", "planner: compiled peak",
           "hand-written: compiled peak"],
        cells,
        right_aligned=[False] * 3 + [True] * (2 * len(groups) + 5),
    )  # fmt: skip
    scattering = [
        f"{name} {r['model']} {r['mesh']}"
        for pair in pairs
        for name, r in zip(("planner", "hand-written"), pair)
        if r["collectives_by_kind"].get("reduce-scatter")
    ]
    return (
        f"Planner over hand-written collective bytes: {min(ratios):.2f} to "
        f"{max(ratios):.2f} over {len(ratios)} rows; the planner's are at most "
        f"the hand-written layout's on {at_most} of {len(pairs)} rows. The "
        f"planner's layout is the hand-written one on {', '.join(same) or 'no row'}. "
        f"The planner above the hand-written layout: {'; '.join(above) or 'no row'}. "
        "Compiles with "
        f"reduce-scatters: {'; '.join(sorted(set(scattering))) or 'none'}.\n\n"
        f"{table}\n"
    )


def render(
    zoo_rows: Sequence[dict],
    megatron_rows: Sequence[dict],
    command: str,
    environment: str,
    seconds: float,
) -> str:
    """The `memory-truth-gpu` section (Markdown)."""
    from keras_autoshard.plans.hardware import hardware_profile
    from keras_autoshard.plans.units import format_bytes

    profile = hardware_profile(TARGET)
    text = (
        f"## Memory truth on XLA:GPU: the zoo's plans made for and compiled "
        f"for {DEVICE_COUNT} {TARGET} GPUs\n\n"
        f"{environment}; the whole run took {seconds / 60:.0f} minutes. Every "
        "row of the zoo table above planned again for the GPU: the same "
        "model, batch, mesh, dtype policy and levers requested "
        f'(`rematerialize="all"`, a budget, LoRA) with `hardware="{TARGET}"`, '
        "so the estimate is XLA:GPU's; a budget row's share is of the GPU "
        "plan's own peak without a budget. Each train step (Adam, MSE, the "
        "plan's rematerialized layers and micro-batches) is compiled by "
        f"XLA:GPU for {DEVICE_COUNT} GPUs ahead of time, with no GPU and no "
        "weight allocated (`compile_for_target`: JAX's CUDA plugin over a "
        "topology of GPUs described by `runtime/gpu_targets/"
        f"{profile.gpu_target}`), with XLA:GPU's default options: its "
        f"latency-hiding scheduler keeps within the device's "
        f"{format_bytes(profile.memory_bytes)}, far above these programs. "
        "*Compiled peak*: arguments + outputs + temporaries − aliased, per "
        "device. *Collectives*: operand bytes per device of the step's "
        "collectives of every kind, by the mesh axes each spans (*other "
        "groups*: device groups that are part of an axis, as where a model's "
        "key/value heads are fewer than the model axis's devices), as they "
        "stand in the program (where a plan accumulates gradients, the step "
        "is one micro-batch's). Regenerate with:\n\n"
        f"```\n{command}\n```\n\n"
        "### Estimated against compiled peak per device\n\n"
        f"{zoo_section(zoo_rows)}"
    )
    if megatron_rows:
        text += (
            "\n### Collective bytes: the planner's free plans against "
            "hand-written Megatron layouts\n\n"
            "Each KerasHub transformer of the zoo (float32): the planner's "
            "plan without a budget (its row above) and the hand-written "
            "Megatron plan (`keras_autoshard/testing/reference_plans.py`: "
            "column-parallel Q/K/V and MLP-up, row-parallel attention output "
            "and MLP-down, "
            "vocabulary-parallel embedding where the axis divides the "
            "vocabulary, data parallel over `batch`), both compiled as above. "
            "XLA:CPU forms no reduce-scatter, so collective bytes compiled "
            "there are only an upper bound; these are XLA:GPU's. Where the "
            "planner's layout is the hand-written one, its compile stands for "
            "both. " + megatron_section(zoo_rows, megatron_rows)
        )
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory_truth_gpu",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--output", help="Markdown file whose section to rewrite")
    parser.add_argument(
        "--models", nargs="+", help="only these zoo models (default: all)"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="processes compiling at once"
    )
    parser.add_argument("--json", help="also write the raw rows here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    from benchmarks.real_size_report import environment_description
    from keras_autoshard.testing.markdown import write_section

    args = parse_args(argv)
    start = time.perf_counter()
    settings = selected_settings(args.models)
    megatron = [
        name for name in MEGATRON_MODELS if args.models is None or name in args.models
    ]
    jobs = [("zoo", index, args.models) for index in range(len(settings))]
    jobs += [("megatron", name, mesh) for mesh in MEGATRON_MESHES for name in megatron]
    labels = [_job_label(job, settings) for job in jobs]
    rows = run_jobs(jobs, args.workers, labels)
    zoo_rows, megatron_rows = rows[: len(settings)], rows[len(settings) :]
    section = render(
        zoo_rows,
        megatron_rows,
        COMMAND,
        environment_description(),
        time.perf_counter() - start,
    )
    print(section)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"zoo": zoo_rows, "megatron": megatron_rows}, file, indent=1)
    if args.output:
        write_section(args.output, SECTION_NAME, section)


if __name__ == "__main__":
    main()
