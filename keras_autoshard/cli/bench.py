"""The `bench` command: run the benchmark scripts and rewrite BENCHMARKS.md.

Each benchmark is a module of a source checkout's `benchmarks/` package
(not installed with the package), run in its own process from the current
directory (`python -m benchmarks.<name>`), as its docstring says to run it:
every one measures its own process (peak memory, simulated devices) and
rewrites only its own section of the output file. Their output is streamed
on stderr above a progress bar across benchmarks; the summary table goes to
stdout.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.table import Table

from keras_autoshard.errors import BenchmarkSetupError
from keras_autoshard.progress import progress_bar


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark script.

    Args:
        name: Name on the command line (`--only NAME`).
        module: Module run with `python -m`.
        section: The BENCHMARKS.md section it rewrites.
        quick_args: Extra arguments for `--quick` (fewer steps or cases).
        summary: One line for `--list`.
    """

    name: str
    module: str
    section: str
    quick_args: tuple[str, ...]
    summary: str

    def command(self, output: str, quick: bool) -> list[str]:
        """The argument vector that runs it, writing to `output`."""
        extra = list(self.quick_args) if quick else []
        return [sys.executable, "-m", self.module, "--output", output, *extra]


BENCHMARKS = {
    benchmark.name: benchmark
    for benchmark in (
        Benchmark(
            "strategies",
            "benchmarks.run_benchmarks",
            "sharding-strategies",
            ("--quick",),
            "sharding strategies compared on GPT-2 and an MLP block (mesh 2x4)",
        ),
        Benchmark(
            "plan_70b",
            "benchmarks.plan_70b",
            "planning-70b",
            ("--mesh", "32x8", "--hardware", "none"),
            "planning a Llama-2-70B-shaped model without weights: time and RSS",
        ),
        Benchmark(
            "planner_zoo",
            "benchmarks.planner_zoo",
            "planner-zoo",
            ("--quick",),
            "automatic plans against hand-written and KerasHub layouts",
        ),
        Benchmark(
            "tensor_parallel",
            "benchmarks.tensor_parallel",
            "tensor-parallel",
            ("--quick",),
            "TensorParallel wrapper at world sizes 2, 4 and 8",
        ),
        Benchmark(
            "checkpoint_loading",
            "benchmarks.checkpoint_loading",
            "checkpoint-loading",
            ("--size-gib", "0.25"),
            "host memory and throughput of sharded checkpoint loading",
        ),
        Benchmark(
            "preset_loading",
            "benchmarks.preset_loading",
            "preset-loading",
            (),
            "host memory of loading a 2 GB KerasHub preset sharded (from_preset)",
        ),
        Benchmark(
            "model_coverage",
            "benchmarks.model_coverage",
            "model-coverage",
            ("--meshes", "2x4"),
            "every exported KerasHub backbone class planned on 2x4, 1x8, 8x1",
        ),
        Benchmark(
            "moe_experts",
            "benchmarks.moe_experts",
            "moe",
            (),
            "KerasHub MoE backbones: expert parallelism vs KerasHub's layout map",
        ),
        Benchmark(
            "torch_ranks",
            "benchmarks.torch_ranks",
            "torch-ranks",
            (),
            "PyTorch backend under torchrun on 2 and 4 gloo ranks",
        ),
        Benchmark(
            "memory_truth",
            "benchmarks.memory_truth",
            "memory-truth",
            ("--skip-real-sizes",),
            "estimated vs compiled peak memory per device; real sizes planned",
        ),
        Benchmark(
            "memory_truth_gpu",
            "benchmarks.memory_truth_gpu",
            "memory-truth-gpu",
            ("--models", "llama"),
            "the zoo's plans made for H100s, compiled by XLA:GPU without a GPU: "
            "estimated vs compiled peak, collective bytes vs hand-written "
            "Megatron (gpu-compile extra)",
        ),
        Benchmark(
            "real_size_gpu",
            "benchmarks.real_size_gpu",
            "real-size-gpu",
            ("--rows", "Llama-3-8B@1x8"),
            "real-size models compiled by XLA:GPU for H100s without a GPU: "
            "estimated vs compiled peak, tokens/s vs published (gpu-compile "
            "extra)",
        ),
        Benchmark(
            "sequence_parallel",
            "benchmarks.sequence_parallel",
            "sequence-parallel",
            ("--models", "gpt2", "llama"),
            "sequence parallelism against the same plan without: compiled "
            "peak, ring bytes",
        ),
        Benchmark(
            "generate_cache",
            "benchmarks.generate_cache",
            "generate",
            ("--models", "gpt2", "llama"),
            "the generate job: estimated peak and key/value cache against a "
            "compiled KerasHub generate_step",
        ),
        Benchmark(
            "torch_loading",
            "benchmarks.torch_loading",
            "torch-loading",
            ("--size-gib", "0.25"),
            "PyTorch backend: host memory per rank building and loading 2 GB",
        ),
    )
}


def find_source_root(modules: Iterable[str] = ()) -> str:
    """The source checkout the benchmarks run from: the current directory.

    Args:
        modules: The benchmark modules (`benchmarks.<name>`) it must hold.

    Returns:
        The current directory.

    Raises:
        BenchmarkSetupError: it holds no `benchmarks/` package or not one
            of `modules`.

    Example:

    ```python
    find_source_root(["benchmarks.plan_70b"])  # "/home/me/keras-autoshard"
    ```
    """
    root = os.getcwd()
    required = ["benchmarks/__init__.py"] + [
        module.replace(".", "/") + ".py" for module in modules
    ]
    missing = [
        path for path in required if not os.path.isfile(os.path.join(root, path))
    ]
    if missing:
        raise BenchmarkSetupError(
            f"The benchmarks live in the source checkout (benchmarks/), which is "
            f"not installed with the package, and {root} has no {missing[0]}: "
            "run `keras-autoshard bench` from the root of a keras-autoshard "
            "checkout."
        )
    return root


def list_benchmarks(console: Console) -> None:
    """Print the benchmarks `--only` accepts."""
    table = Table(title="Benchmarks")
    table.add_column("name")
    table.add_column("section")
    table.add_column("quick arguments")
    table.add_column("what it measures")
    for benchmark in BENCHMARKS.values():
        table.add_row(
            benchmark.name,
            benchmark.section,
            shlex.join(benchmark.quick_args),
            benchmark.summary,
        )
    console.print(table)


def run_bench(
    names: Sequence[str],
    output: str,
    quick: bool = False,
    dry_run: bool = False,
    console: Console | None = None,
) -> int:
    """Run the named benchmarks one after the other; returns an exit code.

    Args:
        names: Keys of `BENCHMARKS`, in the order to run them.
        output: The Markdown file whose sections they rewrite.
        quick: Pass each benchmark's quick arguments.
        dry_run: Print the commands without running them.
        console: Where to print (stdout by default).

    Returns:
        0 if every benchmark succeeded, 1 otherwise.

    Example:

    ```python
    run_bench(["plan_70b"], "BENCHMARKS.md", quick=True)
    ```
    """
    console = console or Console()
    root = find_source_root(BENCHMARKS[name].module for name in names)
    output = os.path.abspath(output)
    commands = {name: BENCHMARKS[name].command(output, quick) for name in names}
    if dry_run:
        for command in commands.values():
            console.print(
                shlex.join(command), markup=False, highlight=False, soft_wrap=True
            )
        return 0
    results: list[tuple[str, int, float]] = []
    with progress_bar("benchmarks", len(commands)) as task:
        for name, command in commands.items():
            task.describe(f"benchmark {name}")
            task.print(f"$ {shlex.join(command)}")
            start = time.perf_counter()
            returncode = _run_streaming(command, root, task)
            results.append((name, returncode, time.perf_counter() - start))
            task.advance()
    console.print(_results_table(results, output))
    return 0 if all(code == 0 for _, code, _ in results) else 1


def _run_streaming(command: list[str], cwd: str, task) -> int:
    env = dict(os.environ)
    env.setdefault("KERAS_BACKEND", "jax")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # Each benchmark sets its own simulated device count.
    env.pop("XLA_FLAGS", None)
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        for line in process.stdout:
            task.print(line.rstrip("\n"))
    return process.returncode


def _results_table(results, output: str) -> Table:
    table = Table(title=f"Benchmarks written to {output}")
    table.add_column("benchmark")
    table.add_column("section")
    table.add_column("time", justify="right")
    table.add_column("result")
    for name, returncode, seconds in results:
        table.add_row(
            name,
            BENCHMARKS[name].section,
            f"{seconds:.0f} s",
            "ok" if returncode == 0 else f"FAILED (exit code {returncode})",
        )
    return table
