"""Memory truth on XLA:GPU: the zoo table's train steps compiled for 8 H200s.

The plans and programs of `benchmarks.memory_truth`'s zoo table, exported
on this machine (`jax.export`, lowered for CUDA) and compiled ahead of time
for 8 GPUs without a device (`jax.experimental.topologies`, the H200's
description read on a lent machine, `targets/nvidia_h200.textproto`), three
ways:

- XLA:GPU's defaults: its latency-hiding scheduler bounds memory by the
  device's (about 140 GiB, far above these programs);
- the same with the device's memory set so that the scheduler's limit is the
  plan's estimated peak (XLA:GPU schedules within 80 % of the device memory,
  less the arguments and outputs): the estimate treated as the budget;
- the latency-hiding scheduler off: XLA:GPU's memory scheduler alone (the
  least peak of a list, a depth-first and a post-order schedule).

Three steps, the second where jax has its CUDA plugin (no GPU needed):

```
python -m benchmarks.memory_truth_gpu export --dir gpu_truth
python -m benchmarks.memory_truth_gpu compile --dir gpu_truth
python -m benchmarks.memory_truth_gpu render --dir gpu_truth --output BENCHMARKS.md
```

When the estimate changes and no GPU is at hand, `recheck` plans and exports
the cases again (into `<dir>/current`) and sets each current estimate
against the stored compiled peaks of the rows whose exported program is
unchanged (source locations aside), in its own section:

```
python -m benchmarks.memory_truth_gpu recheck --dir gpu_truth --output BENCHMARKS.md
```

`export` and `render` need this project's environment; `compile` needs only
jax and its CUDA plugin (imports nothing else of this project).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Sequence

SECTION_NAME = "memory-truth-gpu"
RECHECK_SECTION = "memory-truth-gpu-recheck"
# `loc(...)` references and location definitions of an MLIR module's text.
_LOCATIONS = re.compile(r"\s*loc\([^)]*\)|^#loc.*$", re.MULTILINE)
TARGET = os.path.join(os.path.dirname(__file__), "targets", "nvidia_h200.textproto")
# XLA:GPU's scheduler keeps within this share of the device's memory.
SCHEDULER_SHARE = 0.8
VARIANTS = ("default", "estimate_limit", "memory_scheduler")
# Estimate over compiled peak counted as agreeing (the issue's ±15 %).
AGREE = (0.85, 1.15)


def export_cases(directory: str) -> None:
    """Plan and build each case of the zoo table and export its train step."""
    from keras_autoshard.runtime.devices import simulate_devices

    simulate_devices(8)
    import jax

    from benchmarks.memory_truth import truth_cases
    from keras_autoshard.report.compiled_program import train_step_program

    os.makedirs(directory, exist_ok=True)
    rows = []
    for index, case in enumerate(truth_cases()):
        model, distribution, batch = case.built()
        step, arguments = train_step_program(model, distribution, batch)
        exported = jax.export.export(step, platforms=("cuda",))(*arguments)
        with open(os.path.join(directory, f"case{index:03d}.bin"), "wb") as file:
            file.write(exported.serialize())
        leaves = jax.tree.leaves(arguments)
        mesh = leaves[0].sharding.mesh
        row = case.row()
        row["arguments"] = {
            "state_leaves": len(jax.tree.leaves(arguments[0])),
            "mesh_shape": list(mesh.devices.shape),
            "axis_names": list(mesh.axis_names),
            "leaves": [
                [list(a.shape), str(a.dtype), _spec(a.sharding.spec)] for a in leaves
            ],
        }
        rows.append(row)
        print(index, row["model"], row["mesh"], row["policy"], flush=True)
    with open(os.path.join(directory, "cases.json"), "w") as file:
        json.dump(rows, file, indent=1)


def _spec(spec) -> list:
    """A `PartitionSpec` as JSON (tuples of axes as lists)."""
    return [list(s) if isinstance(s, tuple) else s for s in spec]


def _axes(entry):
    """One entry of a `_spec` back as `PartitionSpec` takes it."""
    return tuple(entry) if isinstance(entry, list) else entry


def compile_cases(directory: str, workers: int) -> None:
    """Compile every exported case in each variant for 8 GPUs; write
    `gpu_results.json` (memory analysis per case and variant)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with open(os.path.join(directory, "cases.json")) as file:
        count = len(json.load(file))
    jobs = [(directory, index, v) for v in VARIANTS for index in range(count)]
    context = multiprocessing.get_context("spawn")
    results: dict = {}
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        for (_, index, variant), result in zip(jobs, pool.map(_compile_job, jobs)):
            results.setdefault(str(index), {})[variant] = result
            print(index, variant, result, flush=True)
    with open(os.path.join(directory, "gpu_results.json"), "w") as file:
        json.dump(results, file, indent=1)


def _compile_job(job) -> dict:
    """In a worker: compile one case in one variant, deviceless."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    directory, index, variant = job
    with open(os.path.join(directory, "cases.json")) as file:
        case = json.load(file)[index]
    with open(TARGET) as file:
        target = file.read()
    if variant == "estimate_limit":
        memory = int(case["estimate"]["peak_bytes"] / SCHEDULER_SHARE)
        target = re.sub(
            r"device_memory_size: \d+", f"device_memory_size: {memory}", target
        )
    options = None
    if variant == "memory_scheduler":
        options = {"xla_gpu_enable_latency_hiding_scheduler": False}
    arguments = case["arguments"]
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=target, topology="1x1x8"
    )
    mesh = Mesh(
        np.array(topology.devices).reshape(arguments["mesh_shape"]),
        tuple(arguments["axis_names"]),
    )
    leaves = [
        jax.ShapeDtypeStruct(
            tuple(shape),
            jax.numpy.dtype(dtype),
            sharding=NamedSharding(mesh, PartitionSpec(*map(_axes, spec))),
        )
        for shape, dtype, spec in arguments["leaves"]
    ]
    with open(os.path.join(directory, f"case{index:03d}.bin"), "rb") as file:
        exported = jax.export.deserialize(bytearray(file.read()))

    def step(state, data):
        args, kwargs = jax.tree.unflatten(exported.in_tree, [*state, *data])
        return exported.call(*args, **kwargs)

    split = arguments["state_leaves"]
    start = time.perf_counter()
    compiled = (
        jax.jit(step, donate_argnums=0)
        .lower(leaves[:split], leaves[split:])
        .compile(compiler_options=options)
    )
    analysis = compiled.memory_analysis()
    # As report.estimate_check.compiled_peak_bytes counts it; this worker
    # imports nothing of keras_autoshard (Keras need not be installed here).
    return {
        "peak": analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes,
        "temp": analysis.temp_size_in_bytes,
        "seconds": time.perf_counter() - start,
        "jax": jax.__version__,
    }


def render(directory: str, command: str) -> str:
    from benchmarks.markdown import markdown_table
    from keras_autoshard.plans.plan_table import format_bytes

    with open(os.path.join(directory, "cases.json")) as file:
        cases = json.load(file)
    with open(os.path.join(directory, "gpu_results.json")) as file:
        results = json.load(file)
    table_rows, ratios = [], {v: [] for v in VARIANTS}
    for index, case in enumerate(cases):
        estimate = case["estimate"]["peak_bytes"]
        cells = [case["model"], case["mesh"], case["policy"], format_bytes(estimate)]
        for variant in VARIANTS:
            peak = results[str(index)][variant]["peak"]
            ratios[variant].append((estimate / peak, case))
            cells += [format_bytes(peak), f"{estimate / peak:.2f}"]
        table_rows.append(cells + [case["levers"]])
    table = markdown_table(
        [
            "model",
            "mesh",
            "policy",
            "estimated peak",
            "XLA:GPU defaults",
            "ratio",
            "limit = estimate",
            "ratio",
            "memory scheduler only",
            "ratio",
            "levers",
        ],
        table_rows,
        right_aligned=[False] * 3 + [True] * 7 + [False],
    )
    jax_version = next(iter(results.values()))["default"]["jax"]

    def span(variant, keep=lambda case: True) -> str:
        values = [r for r, case in ratios[variant] if keep(case)]
        inside = sum(AGREE[0] <= r <= AGREE[1] for r in values)
        return (
            f"{min(values):.2f} to {max(values):.2f} "
            f"({inside} of {len(values)} within ±15 %)"
        )

    float32 = lambda case: "bfloat16" not in case["policy"]  # noqa: E731
    remat = lambda case: bool(re.search("remat|budget", case["policy"]))  # noqa: E731
    return (
        "## Memory truth on XLA:GPU: the same train steps compiled for 8 H200s\n\n"
        "The zoo table's plans and programs above, exported here (`jax.export`, "
        "lowered for CUDA) and compiled ahead of time for 8 GPUs without a "
        "device (`jax.experimental.topologies`; the H200's description read on "
        f"a lent machine; jax {jax_version} with its CUDA plugin). The "
        "estimates are the CPU plans' own: under `mixed_bfloat16` they count "
        "XLA:CPU's float32 work copies of bfloat16 operands, which a GPU does "
        "not make. Three compilations of each step: XLA:GPU's defaults (its "
        "latency-hiding scheduler keeps within the device's 140 GiB, far "
        "above these programs, so it spends memory on overlap freely); the "
        "device's memory set so that the scheduler's limit is the plan's "
        "estimate (the estimate as budget); and the latency-hiding scheduler "
        "off (XLA:GPU's memory scheduler alone). A rematerialized layer's "
        "backward pass gives its variables' gradients together with its "
        "input's (an optimization barrier, `apply/remat.py`); before it did, "
        "XLA:GPU deferred a layer's weight gradients into the previous "
        "layer's backward pass, their operands live beside its recomputed "
        "residuals (measured then: the subclassed model on 2x4 at 0.81 with "
        "the estimate as limit and 0.66 at the defaults; the 26 "
        "rematerializing rows 0.66 to 1.07 at the defaults). Estimate over "
        "compiled:\n\n"
        f"- defaults: {span('default')};\n"
        f"- limit = estimate: {span('estimate_limit')}; float32 rows "
        f"{span('estimate_limit', float32)}; rematerializing rows "
        f"{span('estimate_limit', remat)};\n"
        f"- memory scheduler only: {span('memory_scheduler')}.\n\n"
        "Outside ±15 % with the estimate as limit: "
        f"{_outside(ratios['estimate_limit'])}. On XLA:CPU (the table above) "
        "the same plans' estimates are calibrated; on XLA:GPU the estimate "
        "errs high where a row is above 1.15 (the plan fits with room to "
        "spare) and low where below 0.85.\n\n"
        "Regenerate with:\n\n"
        f"```\n{command}\n```\n\n{table}\n"
    )


def _outside(ratios) -> str:
    rows = [
        f"{case['model']} {case['mesh']} {case['policy']} ({ratio:.2f})"
        for ratio, case in ratios
        if not AGREE[0] <= ratio <= AGREE[1]
    ]
    return "; ".join(rows) or "none"


def _module_text(path: str) -> str:
    """An exported program's module without its source locations."""
    import jax

    with open(path, "rb") as file:
        exported = jax.export.deserialize(bytearray(file.read()))
    text = _LOCATIONS.sub("", exported.mlir_module())
    return "\n".join(line for line in text.splitlines() if line.strip())


def recheck(directory: str, command: str) -> str:
    """The current estimates against the stored XLA:GPU peaks of the rows
    whose exported program is unchanged (Markdown)."""
    from benchmarks.markdown import markdown_table
    from keras_autoshard.plans.plan_table import format_bytes

    current = os.path.join(directory, "current")
    export_cases(current)
    with open(os.path.join(directory, "cases.json")) as file:
        stored = json.load(file)
    with open(os.path.join(current, "cases.json")) as file:
        cases = json.load(file)
    with open(os.path.join(directory, "gpu_results.json")) as file:
        results = json.load(file)
    rows, changed = [], []
    ratios = {"default": [], "memory_scheduler": []}
    earlier = {"default": [], "memory_scheduler": []}
    for index, case in enumerate(cases):
        name = f"case{index:03d}.bin"
        same = _module_text(os.path.join(directory, name)) == _module_text(
            os.path.join(current, name)
        )
        label = f"{case['model']} {case['mesh']} {case['policy']}"
        if not same:
            changed.append(label)
            continue
        estimate = case["estimate"]["peak_bytes"]
        before = stored[index]["estimate"]["peak_bytes"]
        cells = [case["model"], case["mesh"], case["policy"]]
        cells += [format_bytes(before), format_bytes(estimate)]
        for variant in ratios:
            peak = results[str(index)][variant]["peak"]
            ratios[variant].append(estimate / peak)
            earlier[variant].append(before / peak)
            cells += [f"{before / peak:.2f}", f"{estimate / peak:.2f}"]
        rows.append(cells)
    table = markdown_table(
        [
            "model",
            "mesh",
            "policy",
            "estimate compiled for",
            "current estimate",
            "defaults: then",
            "now",
            "memory scheduler only: then",
            "now",
        ],
        rows,
        right_aligned=[False] * 3 + [True] * 6,
    )

    def span(values) -> str:
        inside = sum(AGREE[0] <= r <= AGREE[1] for r in values)
        return (
            f"{min(values):.2f} to {max(values):.2f} "
            f"({inside} of {len(values)} within ±15 %)"
        )

    return (
        "### The current estimate against the same XLA:GPU programs\n\n"
        "The estimate has changed since the programs above were compiled on "
        "a GPU. The cases planned and exported again here: where a row's "
        "exported program is unchanged (its module text, source locations "
        "aside), the compiled peaks above hold for it, and the current "
        f"estimate over them is, at XLA:GPU's defaults, {span(ratios['default'])} "
        f"(the earlier estimate: {span(earlier['default'])}); with its memory "
        f"scheduler alone, {span(ratios['memory_scheduler'])} (earlier: "
        f"{span(earlier['memory_scheduler'])}). XLA:GPU's defaults spend "
        "memory on overlap up to the device's 140 GiB, far above these "
        "programs. Rows whose program changed (a "
        "budget now met by another plan) are left out: "
        f"{'; '.join(changed) or 'none'}. The limit = estimate compilations "
        "set the limit from the earlier estimate, so they are not compared. "
        f"Regenerate with:\n\n```\n{command}\n```\n\n{table}\n"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory_truth_gpu",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("step", choices=("export", "compile", "render", "recheck"))
    parser.add_argument("--dir", required=True, help="folder of the exported cases")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--output", help="Markdown file whose section to rewrite")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.step == "export":
        export_cases(args.dir)
    elif args.step == "compile":
        compile_cases(args.dir, args.workers)
    elif args.step == "recheck":
        from benchmarks.markdown import write_section

        command = (
            "python -m benchmarks.memory_truth_gpu recheck --dir gpu_truth "
            "--output BENCHMARKS.md"
        )
        section = recheck(args.dir, command)
        print(section)
        if args.output:
            write_section(args.output, RECHECK_SECTION, section)
    else:
        from benchmarks.markdown import write_section

        command = "\n".join(
            f"python -m benchmarks.memory_truth_gpu {step} --dir gpu_truth"
            for step in ("export", "compile", "render --output BENCHMARKS.md")
        )
        section = render(args.dir, command)
        print(section)
        if args.output:
            write_section(args.output, SECTION_NAME, section)


if __name__ == "__main__":
    main()
