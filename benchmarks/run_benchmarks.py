"""Compare sharding strategies on benchmark models and rewrite BENCHMARKS.md.

Run from the repository root:

```
python -m benchmarks.run_benchmarks [--quick] [--output BENCHMARKS.md]
    [--models gpt2 mlp_block] [--strategies single handwritten] [--json PATH]
```

Every (model, strategy) case is built, compiled and trained on 8 simulated
host devices in this one process; the results replace the
`sharding-strategies` section of the output file (other sections are kept).
New models go in `benchmarks.models.MODELS`, new strategies in
`benchmarks.strategies.STRATEGIES`.
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
from collections.abc import Mapping, Sequence  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402

from benchmarks.measure import CaseResult, Measurement, measure_case  # noqa: E402
from benchmarks.models import MODELS, MegatronMinimum  # noqa: E402
from benchmarks.report import render_section  # noqa: E402
from benchmarks.strategies import STRATEGIES  # noqa: E402
from keras_autoshard import MeshSpec  # noqa: E402
from keras_autoshard.building import names_replayed_after  # noqa: E402
from keras_autoshard.plans.mesh import DATA_AXIS, MODEL_AXIS  # noqa: E402
from keras_autoshard.testing.markdown import write_section  # noqa: E402

SECTION_NAME = "sharding-strategies"
MESH = MeshSpec((2, 4), (DATA_AXIS, MODEL_AXIS))
TIMED_STEPS = 10
QUICK_TIMED_STEPS = 3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run_benchmarks", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"time {QUICK_TIMED_STEPS} steps per case instead of {TIMED_STEPS}",
    )
    parser.add_argument(
        "--output", default="BENCHMARKS.md", help="Markdown file to update"
    )
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=list(MODELS)
    )
    parser.add_argument(
        "--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES)
    )
    parser.add_argument("--json", help="also write the raw results (exact bytes)")
    return parser.parse_args(argv)


def run_cases(
    model_names: Sequence[str],
    strategy_names: Sequence[str],
    timed_steps: int,
    console: Console,
) -> list[CaseResult]:
    """Measure every (model, strategy) pair, with a progress bar."""
    cases = [(m, s) for m in model_names for s in strategy_names]
    results: list[CaseResult] = []
    with Progress(console=console) as progress:
        task = progress.add_task("benchmarks", total=len(cases))
        for model_name, strategy_name in cases:
            progress.update(task, description=f"{model_name} / {strategy_name}")
            results.append(
                measure_case(
                    model_name,
                    MODELS[model_name],
                    strategy_name,
                    STRATEGIES[strategy_name],
                    MESH,
                    timed_steps,
                )
            )
            progress.advance(task)
    return results


def megatron_minima(model_names: Sequence[str]) -> dict[str, MegatronMinimum]:
    """The analytic Megatron minimum of each model on `MESH`."""
    minima = {}
    for name in model_names:
        case = MODELS[name]
        with names_replayed_after():
            model = case.build()
        minima[name] = case.megatron_minimum(model, MESH)
    return minima


def regenerate_command(argv: Sequence[str]) -> str:
    """The shell command that reruns this benchmark with the same options."""
    return shlex.join(["python", "-m", "benchmarks.run_benchmarks", *argv])


def write_json(
    path: str,
    results: Sequence[CaseResult],
    minima: Mapping[str, MegatronMinimum],
) -> None:
    """The raw results and minima, exact byte counts included, as JSON."""
    records = []
    for result in results:
        record = {"model": result.model, "strategy": result.strategy}
        if isinstance(result, Measurement):
            record.update(
                device_count=result.device_count,
                collective_count=result.collective_count,
                collective_bytes=result.collective_bytes,
                collective_bytes_by_axes={
                    "?" if axes is None else "+".join(axes): n
                    for axes, n in result.collective_bytes_by_axes.items()
                },
                parameter_bytes_per_device=result.parameter_bytes_per_device,
                total_parameter_bytes=result.total_parameter_bytes,
                optimizer_bytes_per_device=result.optimizer_bytes_per_device,
                step_seconds=list(result.step_seconds),
            )
        else:
            record["skipped"] = result.reason
        records.append(record)
    document = {
        "mesh": {"shape": list(MESH.shape), "axis_names": list(MESH.axis_names)},
        "megatron_minimum": {
            name: dataclasses.asdict(minimum) for name, minimum in minima.items()
        },
        "results": records,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)
        f.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks and update the output file; returns an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    console = Console()
    timed_steps = QUICK_TIMED_STEPS if args.quick else TIMED_STEPS
    minima = megatron_minima(args.models)
    results = run_cases(args.models, args.strategies, timed_steps, console)
    section = render_section(
        results=results,
        minima=minima,
        mesh=MESH,
        timed_steps=timed_steps,
        command=regenerate_command(argv),
    )
    write_section(args.output, SECTION_NAME, section)
    if args.json:
        write_json(args.json, results, minima)
    console.print(section, markup=False, highlight=False, soft_wrap=True)
    console.print(f"Wrote section {SECTION_NAME!r} of {args.output}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
