"""The `keras-autoshard` command line (also `python -m keras_autoshard`).

Commands: `plan` (print, save and draw a plan), `inspect` (compile one step
under the plan and compare with the planner's estimate; with `--target`, for
GPUs that are not here, without weights), `bench` (run the
benchmarks and rewrite BENCHMARKS.md) and `demo` (the Quickstart demo).
Bad arguments give a usage error (exit code 2); errors the library reports
(a plan that cannot fit, a model that cannot be built, a damaged file) give
one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence

import keras_autoshard
from keras_autoshard.cli.model_sources import parse_byte_size, parse_mesh_shape
from keras_autoshard.errors import AutoShardError
from keras_autoshard.plans.hardware import PROFILES

DEFAULT_DEVICE_COUNT = 8


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = argparse.ArgumentParser(
        prog="keras-autoshard",
        description="Shard Keras 3 models over many devices automatically.",
    )
    parser.add_argument(
        "--devices",
        type=_positive_int,
        default=None,
        help="devices to plan for; simulated on the host when there is no "
        "accelerator (sets XLA_FLAGS before JAX starts; default 8)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {keras_autoshard.__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    model_options = _model_options()
    plan = commands.add_parser(
        "plan",
        parents=[model_options],
        help="plan a model and print the plan (no weights are allocated)",
        description="Plan a model for a mesh and print the plan as a table.",
    )
    plan.add_argument("--png", help="write a picture of the plan (PNG) here")
    plan.add_argument(
        "--max-rows", type=_positive_int, help="show at most this many variables"
    )
    inspect = commands.add_parser(
        "inspect",
        parents=[model_options],
        help="compile one train step under the plan and compare with the estimate",
        description="Compile one training step under the plan, print the "
        "compiled-program report and the planner's estimate beside it.",
    )
    inspect.add_argument(
        "--tolerance",
        type=float,
        default=0.10,
        help="relative difference flagged between estimate and compiled (0.10)",
    )
    inspect.add_argument(
        "--strict",
        action="store_true",
        help="exit with code 1 when an estimate is flagged",
    )
    inspect.add_argument(
        "--target",
        choices=sorted(
            name for name, profile in PROFILES.items() if profile.gpu_target
        ),
        type=str.lower,
        help="compile the train step with XLA:GPU for the mesh's number of "
        "these GPUs, ahead of time: no device is used and no weight allocated "
        "(the model is built abstractly); the --hardware profile defaults to "
        "it. Needs the gpu-compile extra (JAX's CUDA plugin)",
    )
    _add_bench_parser(commands)
    demo = commands.add_parser(
        "demo", help="shard a small KerasHub GPT-2 over 8 devices and train it"
    )
    demo.add_argument("--steps", type=_positive_int, default=5, help="training steps")
    demo.add_argument(
        "--mesh", type=parse_mesh_shape, default=(2, 4), help="data x model, e.g. 2x4"
    )
    demo.add_argument("--json", default=None, help="write the report as JSON here")
    return parser


def _model_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    source = options.add_argument_group("model (one of)")
    exclusive = source.add_mutually_exclusive_group(required=True)
    exclusive.add_argument(
        "--hub", metavar="CLASS", help="a keras_hub.models class, e.g. GPT2Backbone"
    )
    exclusive.add_argument(
        "--builder",
        metavar="MODULE:FUNCTION",
        help="a Python function returning a keras.Model, e.g. mypkg.models:build",
    )
    exclusive.add_argument(
        "--keras-file", metavar="PATH", help="a model saved with model.save(...)"
    )
    source.add_argument(
        "--config",
        metavar="JSON",
        help="constructor (--hub) or function (--builder) keyword arguments: a "
        "JSON file or inline JSON",
    )
    mesh = options.add_argument_group("mesh and budget")
    mesh.add_argument(
        "--mesh",
        type=parse_mesh_shape,
        help="mesh shape, e.g. 2x4 (data x model); default: the cheapest "
        "(data, model) factorisation of --devices",
    )
    mesh.add_argument(
        "--axis-names",
        type=lambda text: tuple(text.split(",")),
        help="mesh axis names, comma-separated (default batch,model)",
    )
    mesh.add_argument(
        "--devices",
        type=_positive_int,
        default=argparse.SUPPRESS,
        help="devices to plan for when --mesh is not given (default 8)",
    )
    mesh.add_argument(
        "--memory-budget",
        type=parse_byte_size,
        metavar="SIZE",
        help="per-device memory, e.g. 16GiB: the search keeps the whole peak "
        "of a step within it (parameters, gradients, optimizer state, kept "
        "activations, data, transient buffers), rematerializing layers or "
        "accumulating gradients where the sharding alone does not fit "
        "(default: the --hardware profile's usable memory)",
    )
    mesh.add_argument(
        "--rematerialize",
        default="auto",
        type=_parse_remat,
        metavar="auto|none|all|LAYER,...",
        help="auto (default): layers are rematerialized only where the budget "
        "needs it; none; all: every repeated-layer family; or layer names "
        "as a plan lists them (a wrapped backbone's by path), comma-separated",
    )
    mesh.add_argument(
        "--sequence-parallel",
        nargs="?",
        const="on",
        default="off",
        choices=("on", "off", "auto"),
        help="on (the flag alone): cut the token dim of the activations "
        "between tensor-parallel regions over the tensor-parallel axis "
        "(Megatron-SP): those activations shrink by its size, each all-reduce "
        "becomes a reduce-scatter and an all-gather; auto: only where the "
        "budget needs it; off (default)",
    )
    mesh.add_argument(
        "--job",
        choices=("train", "inference", "generate"),
        default="train",
        help="what the budget holds: a training step (default), inference "
        "(variables, data and the largest activations) or generate (inference "
        "plus the key/value cache of every attention at --seq-len tokens)",
    )
    mesh.add_argument(
        "--hardware",
        choices=sorted(PROFILES),
        type=str.lower,
        help="hardware profile: memory (the default budget), peak BF16 FLOP/s "
        "and bandwidths (the estimated step time)",
    )
    mesh.add_argument(
        "--rule",
        type=_parse_rule,
        action="append",
        metavar="REGEX=SPEC",
        help="pin variables matching REGEX to SPEC, e.g. '.*embeddings=model,-' "
        "('-' replicates a dimension); repeatable",
    )
    inputs = options.add_argument_group("sample batch")
    inputs.add_argument("--batch", type=_positive_int, default=8, help="global batch")
    inputs.add_argument(
        "--seq-len",
        type=_positive_int,
        default=128,
        help="size of unknown non-batch input dimensions (sequence length)",
    )
    inputs.add_argument(
        "--input-shape",
        type=parse_mesh_shape,
        metavar="DIMS",
        help="one float input of this shape (without batch), e.g. 16x64, for "
        "models without symbolic inputs",
    )
    output = options.add_argument_group("output")
    output.add_argument("--json", metavar="PATH", help="write the result as JSON")
    output.add_argument(
        "--width", type=_positive_int, help="table width (default: terminal, or 160)"
    )
    return options


def _add_bench_parser(commands) -> None:
    from keras_autoshard.cli.bench import BENCHMARKS

    benchmark_names = list(BENCHMARKS)
    bench = commands.add_parser(
        "bench",
        help="run the benchmarks and rewrite BENCHMARKS.md",
        description="Run the benchmark scripts one after the other, each in "
        "its own process, each rewriting its section of the output file.",
    )
    bench.add_argument(
        "--only",
        nargs="+",
        choices=benchmark_names,
        metavar="NAME",
        help=f"run only these, in this order (of: {', '.join(benchmark_names)})",
    )
    bench.add_argument(
        "--quick", action="store_true", help="fewer timed steps and cases"
    )
    bench.add_argument(
        "--output", default="BENCHMARKS.md", help="Markdown file to rewrite"
    )
    bench.add_argument("--list", action="store_true", help="list the benchmarks")
    bench.add_argument(
        "--dry-run", action="store_true", help="print the commands, run nothing"
    )


def _parse_remat(text: str):
    """`auto`, `none`, `all`, or comma-separated layer names (a tuple)."""
    if text in ("auto", "none", "all"):
        return text
    return tuple(name for name in text.split(",") if name)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _parse_rule(text: str) -> tuple[str, tuple[str | None, ...]]:
    pattern, separator, spec = text.rpartition("=")
    if not separator or not pattern or not spec:
        raise argparse.ArgumentTypeError(
            f"a rule must look like REGEX=SPEC, e.g. '.*embeddings=model,-', got "
            f"{text!r}"
        )
    axes = tuple(
        None if axis.strip() in ("-", "none", "None") else axis.strip()
        for axis in spec.split(",")
    )
    return pattern, axes


def _check_model_args(parser: argparse.ArgumentParser, args) -> None:
    if args.config is not None and args.keras_file:
        parser.error("--config goes with --hub or --builder, not --keras-file")
    if args.axis_names and not args.mesh:
        parser.error("--axis-names needs --mesh")
    if args.mesh and args.axis_names and len(args.axis_names) != len(args.mesh):
        parser.error(
            f"--mesh {'x'.join(map(str, args.mesh))} has {len(args.mesh)} axes but "
            f"--axis-names gives {len(args.axis_names)}"
        )
    if args.mesh and len(args.mesh) != 2 and not args.axis_names:
        parser.error(
            f"a {len(args.mesh)}-axis --mesh needs --axis-names (the default "
            "batch,model names two axes)"
        )
    if args.mesh and args.devices and math.prod(args.mesh) != args.devices:
        parser.error(
            f"--mesh {'x'.join(map(str, args.mesh))} spans {math.prod(args.mesh)} "
            f"devices but --devices is {args.devices}"
        )
    if args.command == "inspect" and not 0 <= args.tolerance:
        parser.error(f"--tolerance must be >= 0, got {args.tolerance}")
    if args.command == "inspect" and args.target and args.job != "train":
        parser.error(
            f"--target compiles the train step; --job {args.job} plans no train step"
        )


def _library_errors() -> tuple[type[BaseException], ...]:
    # Library errors, and the environment's (a missing file or package).
    return (AutoShardError, OSError, ImportError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code.

    Args:
        argv: Arguments without the program name (default `sys.argv[1:]`).

    Returns:
        0 on success, 1 when the work failed, 2 for a usage error.

    Example:

    ```python
    main(["plan", "--hub", "GPT2Backbone", "--config", "cfg.json", "--mesh", "2x4"])
    ```
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.command in ("plan", "inspect"):
        _check_model_args(parser, args)
    if args.command == "inspect" and args.target:
        # A deviceless compile: JAX runs on the host, where the CUDA plugin
        # loads without looking for a GPU (or printing that it found none).
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        return _dispatch(parser, args)
    except _library_errors() as error:
        if args.verbose:
            raise
        print(f"keras-autoshard {args.command}: error: {error}", file=sys.stderr)
        return 1


def _dispatch(parser: argparse.ArgumentParser, args) -> int:
    from keras_autoshard.runtime.devices import simulate_devices

    if args.command == "demo":
        if len(args.mesh) != 2:
            parser.error(
                f"demo needs a 2-axis mesh (data x model), got "
                f"{'x'.join(map(str, args.mesh))}"
            )
        simulate_devices(args.devices or math.prod(args.mesh))
        from keras_autoshard.cli.demo import run_demo

        return run_demo(mesh_shape=args.mesh, steps=args.steps, json_path=args.json)
    if args.command == "bench":
        from rich.console import Console

        from keras_autoshard.cli.bench import BENCHMARKS, list_benchmarks, run_bench

        console = Console(width=None if sys.stdout.isatty() else 160)
        if args.list:
            list_benchmarks(console)
            return 0
        return run_bench(
            args.only or list(BENCHMARKS),
            args.output,
            args.quick,
            args.dry_run,
            console=console,
        )
    # plan and inspect: the planner needs devices only to count them, inspect
    # compiles on them (with --target, on a topology of GPUs that are not here).
    if args.mesh:
        device_count = math.prod(args.mesh)
    else:
        device_count = args.devices or DEFAULT_DEVICE_COUNT
    compiles_for_target = args.command == "inspect" and args.target
    if compiles_for_target:
        args.devices = device_count
        args.hardware = args.hardware or args.target
    elif args.command == "inspect" or not args.mesh:
        simulate_devices(device_count)
    if args.width is None and not sys.stdout.isatty():
        args.width = 160
    from keras_autoshard.cli.plan import run_inspect, run_plan

    return run_plan(args) if args.command == "plan" else run_inspect(args)


if __name__ == "__main__":
    sys.exit(main())
