"""The generate job: estimated peak and key/value cache against a compiled
KerasHub `generate_step`.

Run from the repository root:

```
python -m benchmarks.generate_cache [--output BENCHMARKS.md]
```

Each zoo backbone with a KerasHub CausalLM (GPT-2, OPT, Gemma, Llama with
grouped key/value heads), batch 8 × 64 tokens, float32, on 8 simulated
devices, meshes 2x4, 1x8 and 8x1: the task planned with `job="generate"`
(built around an abstract backbone), then its `generate_step` compiled as
KerasHub's JAX `generate` jits it. The plan's estimated peak (parameters,
inputs, the prompt's transients, the key/value cache) against XLA's memory
analysis (arguments + outputs + temporaries − aliased), and the estimated
cache against the cache buffer XLA keeps per device (read off the
optimized HLO: the 6-dim buffer of (batch, layers, key and value, tokens,
heads, head dim)).

Rows replace the `generate` section of the output file.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from keras_autoshard.runtime.devices import simulate_devices  # noqa: E402

simulate_devices(8)

import argparse  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from benchmarks.report import machine_description  # noqa: E402
from keras_autoshard.plans.units import format_bytes  # noqa: E402
from keras_autoshard.testing.markdown import markdown_table, write_section  # noqa: E402

SECTION_NAME = "generate"
MODELS = ("gpt2", "opt", "gemma", "llama")
MESHES = ((2, 4), (1, 8), (8, 1))
COMMAND = "python -m benchmarks.generate_cache --output BENCHMARKS.md"


def measure(name: str, shape: tuple[int, int]) -> dict:
    """One model's generate step on one mesh."""
    from keras_autoshard.testing.generate import (
        cache_buffer_bytes,
        executable_peak_bytes,
        planned_generate,
    )

    sharding_plan, compiled = planned_generate(name, shape)
    return {
        "model": name,
        "mesh": f"{shape[0]}x{shape[1]}",
        "estimate": sharding_plan.estimate.to_dict(),
        "compiled_peak": executable_peak_bytes(compiled),
        "compiled_cache": max(cache_buffer_bytes(compiled.as_text()), default=0),
    }


def render(rows: Sequence[dict]) -> str:
    """The section's Markdown."""
    table = [
        [
            row["model"],
            row["mesh"],
            format_bytes(row["estimate"]["peak_bytes"]),
            format_bytes(row["compiled_peak"]),
            f"{row['estimate']['peak_bytes'] / row['compiled_peak']:.2f}",
            format_bytes(row["estimate"]["cache_bytes"]),
            format_bytes(row["compiled_cache"]),
        ]
        for row in rows
    ]
    ratios = [r["estimate"]["peak_bytes"] / r["compiled_peak"] for r in rows]
    differ = [
        f"{r['model']} on {r['mesh']}"
        for r in rows
        if r["compiled_cache"] != r["estimate"]["cache_bytes"]
    ]
    caches = (
        "The compiled cache is cut as estimated on every row."
        if not differ
        else "The compiled cache is cut as estimated but for "
        + ", ".join(differ)
        + ": there XLA lays the cache out otherwise."
    )
    header = [
        "model",
        "mesh",
        "estimated peak",
        "compiled peak",
        "ratio",
        "estimated cache",
        "compiled cache",
    ]
    return (
        "## Generate: the key/value cache\n\n"
        f"Regenerate: `{COMMAND}`. Machine: {machine_description()}, 8 "
        "simulated devices.\n\n"
        "Each zoo backbone's KerasHub CausalLM (batch 8 × 64 tokens, float32) "
        'planned with `job="generate"`: parameters, inputs, the prompt\'s '
        "transients and the key/value cache, whose keys and values the "
        "planner finds by graph shape (`graph/kv_cache.py`). Compiled: "
        "`generate_step` as KerasHub's JAX `generate` jits it (XLA memory "
        "analysis: arguments + outputs + temporaries − aliased); compiled "
        "cache: the cache buffer in the optimized HLO, per device. Ratios "
        f"from {min(ratios):.2f} to {max(ratios):.2f}. The kernels XLA:CPU "
        "copies into another layout for their matmuls, all made at the "
        "program's start, are counted (`cost_model.relaid_weights`: "
        "Gemma's eight attention kernels, Llama's two output kernels; "
        "without them Gemma on 8x1 measured 0.73 and Llama on 2x4 0.83). "
        "Where the estimate is low (below 0.9), the prompt's pass holds "
        "three activations of the residual stream's size at once (the "
        "embedding's all-reduced output, a row-parallel output and its "
        "all-reduced copy) where the estimate counts two (the buffers "
        "live at the peak of Llama on 2x4, `xla_dump_to`). "
        "KerasHub makes the cache inside "
        "`generate_step` (`ops.zeros`), where no Keras distribution hook "
        "reaches: the plan pins the outputs of the layers that make the keys "
        "and values (not those whose other calls are laid out otherwise, such "
        "as Llama's rotary embedding, which turns the queries too: pinned, "
        "XLA gathered every query head), and XLA lays the cache out from "
        "what is written into it "
        f"(unpinned, it kept OPT's cache whole on 8x1). {caches}\n\n"
        + markdown_table(header, table)
        + "\n"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.generate_cache",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--output", default="BENCHMARKS.md")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    rows = [measure(name, shape) for shape in MESHES for name in args.models]
    for row in rows:
        print(
            row["model"],
            row["mesh"],
            row["estimate"]["peak_bytes"] / row["compiled_peak"],
            row["estimate"]["cache_bytes"],
            row["compiled_cache"],
            flush=True,
        )
    write_section(args.output, SECTION_NAME, render(rows))


if __name__ == "__main__":
    main()
