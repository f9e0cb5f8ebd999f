"""The `keras-autoshard` command line (also `python -m keras_autoshard`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-autoshard",
        description="Shard Keras 3 models over many devices automatically.",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="simulate this many host devices when there is no accelerator "
        "(sets XLA_FLAGS before JAX starts; default 8 with no accelerator)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="shard a small KerasHub GPT-2 over 8 devices and train it"
    )
    demo.add_argument("--steps", type=int, default=5, help="training steps")
    demo.add_argument("--mesh", default="2x4", help="data x model mesh, e.g. 2x4")
    demo.add_argument("--json", default=None, help="write the report as JSON here")
    return parser


def parse_mesh(text: str) -> tuple[int, ...]:
    """`"2x4"` → `(2, 4)`; raises `argparse.ArgumentTypeError` otherwise."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(size < 1 for size in shape):
        raise argparse.ArgumentTypeError(
            f"mesh must look like 2x4 (sizes >= 1 joined by 'x'), got {text!r}"
        )
    return shape


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from keras_autoshard.devices import simulate_devices

    if args.command == "demo":
        try:
            mesh_shape = parse_mesh(args.mesh)
        except argparse.ArgumentTypeError as error:
            parser.error(str(error))
        if len(mesh_shape) != 2:
            parser.error(f"demo needs a 2-axis mesh (data x model), got {args.mesh}")
        device_count = args.devices or mesh_shape[0] * mesh_shape[1]
        simulate_devices(device_count)
        from keras_autoshard.demo import run_demo

        return run_demo(mesh_shape=mesh_shape, steps=args.steps, json_path=args.json)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
