"""Memory truth: the plan's estimated peak per device against the compiled
train step's, and the estimate at real sizes.

Run from the repository root:

```
python -m benchmarks.memory_truth [--output BENCHMARKS.md] [--skip-real-sizes]
```

1. Plans that rematerialize (under budgets that need it, and every layer
   rematerialized on each mesh and under `mixed_bfloat16`), a LoRA
   fine-tune on each mesh, and every model of the test zoo on 8 simulated
   devices, meshes 2x4, 1x8 and 8x1 (float32), and on 2x4 under
   `mixed_bfloat16`: the plan's estimate
   (`plan.estimate`: parameters, gradients, optimizer, activations kept,
   inputs and targets, transient, peak) against XLA's memory analysis of the
   jitted Keras train step (arguments + outputs + temporaries − aliased),
   and their ratio. XLA:CPU runs bfloat16 arithmetic in float32, and the
   estimate for a CPU plan counts it so: its work buffers, and the float32
   copies of the bfloat16 operands of matrix products that it keeps for the
   backward pass (`cost_model.kept_widening`).
2. Real sizes, no weights allocated, each planned in a fresh process on
   this machine with the H100-80GB profile: Llama-2-70B (batch 256 × 4096) on
   32x8 (also with `sequence_parallel="auto"`), Llama-3-8B (32 × 8192) on
   1x8, Mixtral-8x7B (64 × 4096) on 8x8, Llama-3.1-405B (512 × 4096) on
   64x8: planning time, peak RSS, the
   estimated peak against the budget, communication, step time.

Rows replace the `memory-truth` section of the output file.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from keras_autoshard.runtime.devices import simulate_devices  # noqa: E402

simulate_devices(8)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.report import machine_description  # noqa: E402
from keras_autoshard.plans.estimate import HEADROOM  # noqa: E402
from keras_autoshard.plans.units import format_bytes  # noqa: E402
from keras_autoshard.testing.markdown import (  # noqa: E402
    markdown_table,
    short_levers,
    write_section,
)

SECTION_NAME = "memory-truth"
MESHES = ((2, 4), (1, 8), (8, 1))
CONFIGS = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "examples", "configs"
)
# name, KerasHub class, config file, mesh, batch, sequence, published configuration
REAL_SIZES = (
    (
        "Llama-2-70B",
        "LlamaBackbone",
        "llama2_70b.json",
        (32, 8),
        256,
        4096,
        "torchtitan Llama-3.1-70B on 256 H100: FSDP 32 × TP 8 with activation "
        "checkpointing; MaxText Llama2-70B on v5p: FSDP with full remat",
    ),
    (
        "Llama-2-70B, sequence_parallel='auto'",
        "LlamaBackbone",
        "llama2_70b.json",
        (32, 8),
        256,
        4096,
        "MaxText on GPUs: FSDP with Megatron-style sequence parallelism",
    ),
    (
        "Llama-3-8B",
        "LlamaBackbone",
        "llama3_8b.json",
        (1, 8),
        32,
        8192,
        "torchtitan Llama-3-8B on 8 H100: FSDP 8, selective activation checkpointing",
    ),
    (
        "Mixtral-8x7B",
        "MixtralBackbone",
        "mixtral_8x7b.json",
        (8, 8),
        64,
        4096,
        "MaxText Mixtral-8x7B: FSDP with expert parallelism and remat",
    ),
    (
        "Llama-3.1-405B",
        "LlamaBackbone",
        "llama3_405b.json",
        (64, 8),
        512,
        4096,
        "Meta's Llama-3.1-405B training: TP 8 × PP 16 × DP, full activation "
        "recomputation where needed",
    ),
)


@dataclasses.dataclass(frozen=True)
class TruthSetting:
    """What one row of the zoo table asks the planner for: the model, its
    batch, the mesh, the dtype policy and the levers requested.

    Args:
        model: The zoo model's name (or "gemma + LoRA r4").
        policy: What the row says of the dtype policy and levers.
        dtype_policy: The Keras dtype policy the model is planned, built and
            compiled under.
        build: Builds the model.
        x: One global batch of inputs.
        mesh_shape: `(batch, model)` sizes of the mesh.
        rematerialize: `plan`'s `rematerialize`.
        budget_share: The memory budget as a share of the peak of the plan
            made without one (`None`: no budget).
    """

    model: str
    policy: str
    dtype_policy: str
    build: Callable
    x: Any
    mesh_shape: tuple[int, int]
    rematerialize: str = "auto"
    budget_share: float | None = None

    def scope(self) -> contextlib.AbstractContextManager:
        """The row's dtype policy as the global one, float32 after."""
        return _policy(self.dtype_policy)

    def plan(self, hardware: str | None = None):
        """The planner's plan for this row (call it within `scope()`); with
        `hardware`, made for that profile (its compiler's estimate), the
        budget share then of that profile's plan without a budget."""
        from keras_autoshard import MeshSpec, plan

        mesh = MeshSpec(self.mesh_shape, ("batch", "model"))
        options: dict[str, Any] = {"rematerialize": self.rematerialize}
        if hardware is not None:
            options["hardware"] = hardware
        if self.budget_share is not None:
            free = plan(self.build, mesh, self.x, **options)
            options["memory_budget"] = int(self.budget_share * free.estimate.peak_bytes)
        return plan(self.build, mesh, self.x, **options)


@dataclasses.dataclass
class TruthCase:
    """One row of the zoo table: a plan, the model it is for, one batch.

    Args:
        model: The zoo model's name (or "gemma + LoRA r4").
        policy: What the row says of the dtype policy and levers.
        sharding_plan: The plan.
        build: Builds the model.
        x: One global batch of inputs.
        setting: What the row asked the planner for (`None` if not known).
    """

    model: str
    policy: str
    sharding_plan: Any
    build: Callable
    x: Any
    setting: TruthSetting | None = None

    @property
    def mesh(self) -> str:
        shape = self.sharding_plan.mesh.shape
        return f"{shape[0]}x{shape[1]}"

    def compiled(self):
        """The train step compiled as the plan says (`compiled_as_planned`)
        on random targets, on XLA:CPU scheduled for memory with its
        optimization barriers kept (`MEMORY_SCHEDULE_ON_CPU`), as
        accelerators compile."""
        from keras_autoshard.report.compiled_program import MEMORY_SCHEDULE_ON_CPU
        from keras_autoshard.testing import zoo
        from keras_autoshard.testing.compiled import compiled_as_planned

        y = zoo.random_targets(self.build, self.x)
        return compiled_as_planned(
            self.sharding_plan,
            self.build,
            self.x,
            y,
            compiler_options=MEMORY_SCHEDULE_ON_CPU,
        )

    def row(self) -> dict:
        """What the table shows but the compiled figures."""
        return {
            "model": self.model,
            "mesh": self.mesh,
            "policy": self.policy,
            "estimate": self.sharding_plan.estimate.to_dict(),
            "levers": short_levers(self.sharding_plan),
        }


def truth_settings() -> Iterator[TruthSetting]:
    """What each row of the zoo table asks the planner for, in the table's
    order: plans that rematerialize, a LoRA fine-tune, then the planner's
    free plans."""
    yield from remat_settings()
    yield from lora_settings()
    yield from free_settings()


def truth_cases() -> Iterator[TruthCase]:
    """The zoo table's cases in its order, planned for the simulated CPU
    devices. Each is yielded under its dtype policy (build and compile it
    before the next)."""
    for setting in truth_settings():
        with setting.scope():
            sharding_plan = setting.plan()
            yield TruthCase(
                setting.model,
                setting.policy,
                sharding_plan,
                setting.build,
                setting.x,
                setting,
            )


def zoo_rows() -> list[dict]:
    """Estimate against compiled for every case of `truth_cases`
    (`TruthCase.compiled`)."""
    from keras_autoshard.report.estimate_check import compiled_peak_bytes
    from keras_autoshard.report.hlo.schedules import schedule_peaks

    rows = []
    for case in truth_cases():
        report = case.compiled()
        row = case.row()
        row["compiled_peak"] = compiled_peak_bytes(report.train_step.memory)
        row["compiled_communication"] = report.train_step.operand_bytes()
        row["least_schedule_peak"] = schedule_peaks(report.train_step.hlo_text).least
        rows.append(row)
    return rows


@contextlib.contextmanager
def _policy(name: str):
    import keras

    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def free_settings() -> Iterator[TruthSetting]:
    """Every zoo model planned with no budget on each mesh (float32), and
    on 2x4 under `mixed_bfloat16`."""
    from keras_autoshard.testing import zoo

    cases = [("float32", shape) for shape in MESHES] + [("mixed_bfloat16", (2, 4))]
    for policy, shape in cases:
        for name in sorted(zoo.ZOO):
            build, batch = zoo.ZOO[name]
            yield TruthSetting(name, policy, policy, build, batch(), shape)


# Zoo models planned under a budget that needs rematerialization: share of
# the plan's own peak without a budget.
REMAT_CASES = (("llama", 0.7), ("subclassed", 0.75))
# Zoo models with a repeated-layer family, planned with every layer of it
# rematerialized (`rematerialize="all"`).
REMAT_ZOO = ("bert", "gemma", "gpt2", "llama", "opt", "subclassed")


def remat_settings() -> Iterator[TruthSetting]:
    """Plans that rematerialize: the planner's own under budgets that need
    it (trained as the plan says, accumulation included), then every layer
    rematerialized on each mesh and once under `mixed_bfloat16`."""
    from keras_autoshard.testing import zoo

    for name, share in REMAT_CASES:
        build, batch = zoo.ZOO[name]
        policy = f"float32, budget {share:.0%} of the free peak"
        yield TruthSetting(
            name, policy, "float32", build, batch(), (2, 4), budget_share=share
        )
    cases = [("float32", shape) for shape in MESHES] + [("mixed_bfloat16", (2, 4))]
    for policy, shape in cases:
        for name in REMAT_ZOO:
            build, batch = zoo.ZOO[name]
            yield TruthSetting(
                name,
                f"{policy}, remat all",
                policy,
                build,
                batch(),
                shape,
                rematerialize="all",
            )


def lora_settings() -> Iterator[TruthSetting]:
    """A Gemma-shaped backbone with `enable_lora(rank=4)` on each mesh:
    optimizer state for the LoRA kernels only."""
    from keras_autoshard.testing import zoo

    def build():
        model = zoo.gemma()
        model.enable_lora(rank=4)
        return model

    x = zoo.ZOO["gemma"][1]()
    for shape in MESHES:
        yield TruthSetting(
            "gemma + LoRA r4", "float32, LoRA kernels train", "float32", build, x, shape
        )


def plan_in_this_process(
    hub_class: str, config: str, mesh, batch: int, seq: int, sequence_parallel=False
):
    """Child: plan one real-size model shapes-only; print a JSON line."""
    import jax
    import keras_hub
    import numpy as np

    from keras_autoshard import MeshSpec
    from keras_autoshard.planner.plan_request import PlanRequest
    from keras_autoshard.planner.planner import plan_with_cost

    with open(os.path.join(CONFIGS, config)) as file:
        kwargs = json.load(file)
    # As these models are trained: bfloat16 compute, float32 variables.
    kwargs["dtype"] = "mixed_bfloat16"
    cls = getattr(keras_hub.models, hub_class)
    sample = {
        "token_ids": jax.ShapeDtypeStruct((batch, seq), np.int32),
        "padding_mask": jax.ShapeDtypeStruct((batch, seq), np.int32),
    }
    start = time.perf_counter()
    result = plan_with_cost(
        lambda: cls(**kwargs),
        MeshSpec(tuple(mesh), ("batch", "model")),
        sample,
        PlanRequest(hardware="h100-80gb", sequence_parallel=sequence_parallel),
    )
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "seconds": seconds,
                "rss": _peak_rss_bytes(),
                "estimate": result.plan.estimate.to_dict(),
                "plan_json": result.plan.to_json(),
            }
        )
    )


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (`VmHWM`: per address space;
    `getrusage`'s maximum also counts the parent's image before `exec`)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def real_size_rows() -> list[dict]:
    rows = []
    for name, hub_class, config, mesh, batch, seq, published in REAL_SIZES:
        command = [
            sys.executable, "-m", "benchmarks.memory_truth", "--child-plan",
            hub_class, config, f"{mesh[0]}x{mesh[1]}", str(batch), str(seq),
        ]  # fmt: skip
        if "sequence_parallel" in name:
            command.append("--child-sequence-parallel")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: {done.stderr[-3000:]}")
        child = json.loads(done.stdout.strip().splitlines()[-1])
        twice = subprocess.run(command, capture_output=True, text=True)
        again = json.loads(twice.stdout.strip().splitlines()[-1])
        from keras_autoshard import ShardingPlan
        from keras_autoshard.plans.estimate import PlanEstimate

        planned = ShardingPlan.from_json(child["plan_json"])
        rows.append(
            {
                "model": name,
                "mesh": f"{mesh[0]}x{mesh[1]}",
                "levers": short_levers(planned),
                "fits": PlanEstimate.from_dict(child["estimate"]).fits,
                "batch": batch,
                "seq": seq,
                "seconds": child["seconds"],
                "rss": child["rss"],
                "estimate": child["estimate"],
                "deterministic": child["plan_json"] == again["plan_json"],
                "published": published,
                "layout": _layout_summary(planned),
            }
        )
    return rows


def _layout_summary(sharding_plan) -> str:
    """How the plan cuts the parameter bytes: the share cut over each mesh
    axis, the layers rematerialized, the accumulation."""
    total = sharding_plan.total_bytes()
    parts = []
    for axis, size in zip(sharding_plan.mesh.axis_names, sharding_plan.mesh.shape):
        cut = sum(
            v.total_bytes
            for v in sharding_plan.variables
            if any(axis == s or (isinstance(s, tuple) and axis in s) for s in v.spec)
        )
        parts.append(f"{cut / total:.0%} of parameter bytes cut over {axis} ({size})")
    parts.append(short_levers(sharding_plan))
    return "; ".join(parts)


def _or_dash(value, format_value) -> str:
    return "—" if value is None else format_value(value)


def render(zoo: Sequence[dict], real: Sequence[dict], command: str) -> str:
    zoo_table = markdown_table(
        [
            "model",
            "mesh",
            "policy",
            "estimated peak",
            "compiled peak",
            "ratio",
            "least of list / depth-first / post order, replayed",
            "ratio to it",
            "activations kept",
            "transient",
            "levers",
        ],
        [
            [
                r["model"],
                r["mesh"],
                r["policy"],
                format_bytes(r["estimate"]["peak_bytes"]),
                format_bytes(r["compiled_peak"]),
                f"{r['estimate']['peak_bytes'] / r['compiled_peak']:.2f}",
                _or_dash(r.get("least_schedule_peak"), format_bytes),
                _or_dash(
                    r.get("least_schedule_peak"),
                    lambda least, row=r: f"{row['estimate']['peak_bytes'] / least:.2f}",
                ),
                format_bytes(r["estimate"]["activation_bytes"]),
                format_bytes(r["estimate"]["transient_bytes"]),
                r.get("levers", "none"),
            ]
            for r in zoo
        ],
        right_aligned=[False] * 3 + [True] * 7 + [False],
    )
    ratios = [r["estimate"]["peak_bytes"] / r["compiled_peak"] for r in zoo]
    replayed = [
        r["estimate"]["peak_bytes"] / r["least_schedule_peak"]
        for r in zoo
        if "least_schedule_peak" in r
    ]
    text = (
        "## Memory truth: estimated against compiled peak per device\n\n"
        f"{machine_description()}, 8 simulated devices. The plan's estimate "
        "(`plan.estimate.peak_bytes`: parameters, gradients, Adam's two slots, "
        "the activations the backward pass keeps, inputs and targets, transient "
        "buffers) against XLA's memory analysis of the jitted Keras train step "
        "(arguments + outputs + temporaries − aliased). Every step is compiled "
        "as accelerators compile it: scheduled for memory, its optimization "
        "barriers kept (`MEMORY_SCHEDULE_ON_CPU`; XLA:CPU's defaults order a "
        "program for throughput, remove the barriers early and so merge a "
        "rematerialized layer's recomputation back into the forward pass). "
        f"Ratios from {min(ratios):.2f} to {max(ratios):.2f} over {len(zoo)} "
        "rows. The first rows rematerialize: the planner's own plans under "
        "budgets that need it (compiled and trained as the plan says), then "
        'every repeated layer rematerialized (`rematerialize="all"`) on each '
        "mesh and under `mixed_bfloat16`; the estimate follows the backward "
        "pass layer by layer (a recomputed layer's residuals meet the "
        "gradients made before it, `remat.backward_stages`), and a "
        "rematerialized layer's weight gradients are tied to its input's "
        "gradient (`apply/remat.py`). Then a LoRA fine-tune (only the LoRA "
        "kernels carry gradients and Adam's moments), then the planner's free "
        "plans. The estimate counts what XLA materialises: a derivative's "
        "intermediate of an elementwise operation (the `2 x` of a square read "
        "only by a reduction) is recomputed in the backward fusion from what "
        "is kept anyway, a dropout mask is kept as the random bits it is made "
        "from, and the step's phases (backward pass, loss, a pooling's "
        "workspace, the update under gradient accumulation) are counted apart. "
        "The low end is XLA:CPU's memory scheduler, depth-first from the "
        "step's outputs: it runs some weight gradients late, their operands "
        "live into the next layer's backward pass (the subclassed model). "
        "XLA:GPU keeps the least peak of a list, a depth-first and a "
        "post-order schedule (`DefaultMemoryScheduler`): the replayed column "
        "sums the bytes live when the same compiled instructions run in each "
        "of those orders (`report/hlo/schedules.py`; no buffer sharing or "
        "packing); the estimate over that least ranges from "
        f"{min(replayed, default=0):.2f} to {max(replayed, default=0):.2f}. "
        "The same rows planned for H100s and compiled by XLA:GPU are in the next "
        "section. "
        "Regenerate with:\n\n"
        f"```\n{command}\n```\n\n{zoo_table}\n"
    )
    if real:
        real_table = markdown_table(
            [
                "model",
                "mesh",
                "batch × seq",
                "planned in",
                "peak RSS",
                "estimated peak / device",
                "of which activations",
                "budget (H100-80GB)",
                "fits",
                "levers",
                "communication / step",
                "step time",
                "same plan twice",
            ],
            [
                [
                    r["model"],
                    r["mesh"],
                    f"{r['batch']} × {r['seq']}",
                    f"{r['seconds']:.1f} s",
                    format_bytes(r["rss"]),
                    format_bytes(r["estimate"]["peak_bytes"]),
                    format_bytes(r["estimate"]["activation_bytes"]),
                    format_bytes(r["estimate"]["budget_bytes"]),
                    "yes" if r["fits"] else "no",
                    r["levers"],
                    format_bytes(sum(r["estimate"]["communication_by_axis"].values())),
                    f"{r['estimate']['step_time_s']:.2f} s",
                    "yes" if r["deterministic"] else "no",
                ]
                for r in real
            ],
            right_aligned=[
                False,
                False,
                True,
                True,
                True,
                True,
                True,
                True,
                False,
                False,
                True,
                True,
                False,
            ],
        )
        published = "\n".join(
            f"- {r['model']}: published: {r['published']}. This plan: {r['layout']}."
            for r in real
        )
        text += (
            "\n### Real sizes, no weights allocated (`mixed_bfloat16`)\n\n"
            "Each planned in a fresh process on this machine, twice (the last "
            "column compares the two plans' JSON), with the H100-80GB profile: "
            "its usable memory (76 GiB) is the budget, plans fill at most "
            f"{1 - HEADROOM['XLA:GPU']:.0%} of it (`HEADROOM`), and step "
            "time is the objective among plans that fit. The "
            "search bounds the whole peak and chooses rematerialization of "
            "repeated layers (fewest that fit) and, only when nothing else "
            "fits, gradient accumulation; weights stored cut (FSDP) count their "
            "gathered copies the backward pass keeps. Sequence parallelism is "
            "used only where asked (`sequence_parallel='auto'`, the row so "
            "named). Published "
            "configurations for comparison:\n\n"
            f"{published}\n\n{real_table}\n"
        )
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory_truth", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--output", help="Markdown file whose section to rewrite")
    parser.add_argument("--skip-real-sizes", action="store_true")
    parser.add_argument("--json", help="also write the raw rows here")
    parser.add_argument("--child-plan", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument(
        "--child-sequence-parallel", action="store_true", help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child_plan:
        hub_class, config, mesh, batch, seq = args.child_plan
        shape = tuple(int(s) for s in mesh.split("x"))
        plan_in_this_process(
            hub_class,
            config,
            shape,
            int(batch),
            int(seq),
            "auto" if args.child_sequence_parallel else False,
        )
        return
    zoo = zoo_rows()
    real = [] if args.skip_real_sizes else real_size_rows()
    command = "python -m benchmarks.memory_truth --output BENCHMARKS.md"
    section = render(zoo, real, command)
    print(section)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"zoo": zoo, "real": real}, file, indent=1)
    if args.output:
        write_section(args.output, SECTION_NAME, section)


if __name__ == "__main__":
    main()
