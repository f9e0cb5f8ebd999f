"""Plan a Llama-2-70B-shaped model without allocating weights; time and RSS.

Run in its own process (peak RSS is per process):
`python -m benchmarks.plan_70b [--output BENCHMARKS.md]`. It writes the
`planning-70b` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", default="BENCHMARKS.md")
    parser.add_argument(
        "--mesh",
        nargs="+",
        default=["32x8", "16x16"],
        help="data x model meshes, e.g. 32x8 16x16",
    )
    parser.add_argument(
        "--hardware",
        nargs="+",
        default=["none", "h100-80gb"],
        help="hardware profiles whose memory is the budget ('none': no budget)",
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import jax
    import keras_hub
    import numpy as np

    from keras_autoshard import MeshSpec
    from keras_autoshard.planner.plan_request import PlanRequest
    from keras_autoshard.planner.planner import plan_with_cost
    from keras_autoshard.plans.estimate import HEADROOM
    from keras_autoshard.plans.units import format_bytes
    from keras_autoshard.testing.markdown import short_levers, write_section

    def build():
        return keras_hub.models.LlamaBackbone(
            vocabulary_size=32000,
            num_layers=80,
            num_query_heads=64,
            num_key_value_heads=8,
            hidden_dim=8192,
            intermediate_dim=28672,
        )

    inputs = {
        "token_ids": jax.ShapeDtypeStruct((args.batch, args.seq), np.int32),
        "padding_mask": jax.ShapeDtypeStruct((args.batch, args.seq), np.int32),
    }
    rows, notes = [], []
    cases = [(m, h) for m in args.mesh for h in args.hardware]
    for mesh_text, hardware in cases:
        data, model = (int(s) for s in mesh_text.split("x"))
        mesh = MeshSpec((data, model), ("batch", "model"))
        profile = None if hardware == "none" else hardware
        start = time.perf_counter()
        result = plan_with_cost(build, mesh, inputs, PlanRequest(hardware=profile))
        seconds = time.perf_counter() - start
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        estimate = result.plan.estimate
        budget = estimate.budget_bytes
        rows.append(
            f"| {mesh.describe()} | "
            f"{'none' if budget is None else f'{hardware}: {format_bytes(budget)}'} | "
            f"{format_bytes(result.plan.total_bytes())} | "
            f"{seconds:.1f} s | {format_bytes(peak_rss)} | "
            f"{format_bytes(estimate.parameter_bytes)} | "
            f"{format_bytes(estimate.gradient_bytes)} | "
            f"{format_bytes(estimate.optimizer_bytes)} | "
            f"{format_bytes(estimate.activation_bytes)} | "
            f"{format_bytes(estimate.peak_bytes)} | "
            f"{short_levers(result.plan)} | "
            f"{format_bytes(sum(estimate.communication_by_axis.values()))} |"
        )
        # The planner gives one note per kind, with its count of calls.
        gqa = [n for n in result.plan.notes if "GQA" in n]
        notes += [f"{mesh_text}: {n}" for n in dict.fromkeys(gqa)]
    lines = [
        "## Planning a Llama-2-70B-shaped model (no weights allocated)",
        "",
        f"Command: `python -m benchmarks.plan_70b --mesh {' '.join(args.mesh)} "
        f"--hardware {' '.join(args.hardware)} --batch {args.batch} --seq "
        f"{args.seq}` (one process, plans made one after the other; 2-core CPU; "
        "float32). With a hardware profile its memory is the budget of the "
        "whole peak (parameters, gradients, optimizer state, activations kept "
        "for the backward pass, inputs, transients; plans fill at most "
        f"{1 - HEADROOM['XLA:GPU']:.0%} of it, `HEADROOM`): "
        "the planner adds FSDP-style sharding over the data axis, "
        "rematerializes layers and, last, accumulates gradients over "
        "micro-batches. Without one nothing bounds the peak (the activations "
        "are those of the whole batch, no rematerialization). Peak RSS is the "
        "process's maximum resident size so far, Python, JAX, Keras and "
        "KerasHub (with TensorFlow) included.",
        "",
        "| mesh | budget | parameters (total) | planning time | peak RSS | "
        "params/device | grads/device | optimizer/device | activations kept/device "
        "| peak/device | levers | communication/step/device |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|",
        *rows,
    ]
    if notes:
        lines += ["", "Planner notes:", "", *(f"- {n}" for n in dict.fromkeys(notes))]
    write_section(args.output, "planning-70b", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
