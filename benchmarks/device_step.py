"""One training step on a real GPU against the plan's estimates.

Run on a machine with one NVIDIA GPU (JAX with CUDA, Keras, KerasHub):

```
python -m benchmarks.device_step --json benchmarks/device_results/nvidia_h200.json
python -m benchmarks.device_step --batch 32 \
    --json benchmarks/device_results/nvidia_h200_batch32.json
python -m benchmarks.device_step --batch 32 --budget 64GiB \
    --json benchmarks/device_results/nvidia_h200_batch32_budget64gib.json
python -m benchmarks.device_step --batch 32 --budget 32GiB \
    --json benchmarks/device_results/nvidia_h200_batch32_budget32gib.json
python -m benchmarks.device_step --batch 128 --budget 48GiB \
    --json benchmarks/device_results/nvidia_h200_batch128_budget48gib.json
python -m benchmarks.device_step --batch 256 --budget 64GiB \
    --json benchmarks/device_results/nvidia_h200_batch256_budget64gib.json
```

then, anywhere, put the figures into `BENCHMARKS.md`:

```
python -m benchmarks.device_step --render benchmarks/device_results/nvidia_h200*.json \
    --output BENCHMARKS.md
```

The JSON of the last run on a GPU is committed beside this file
(`device_results/`), so the section regenerates without a GPU.

A KerasHub `LlamaBackbone` at Llama-3.2-1B's widths (1.24 B parameters,
`mixed_bfloat16`) is planned for a 1x1 mesh under the hardware profile of
the GPU found (`h200`, `h100-80gb`, ...), shapes only. Then, in the same
process:

1. the plan's train step is compiled for that profile deviceless
   (`compile_for_target`: XLA:GPU over the profile's target description,
   no weight allocated), as on a machine without a GPU;
2. the model is built on the GPU as the plan says (its rematerialized
   layers, its micro-batches, Adam), and the train step `fit` runs
   (`train_step_program`) is compiled for the device and run on random
   tokens: `WARMUP_STEPS` calls, then `TIMED_STEPS` calls timed one by one
   (each waits for its result); the device's `peak_bytes_in_use` is read
   after them.

The JSON holds every figure; `--render` writes the `device-step` section
(`device_step_report.render`).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

SECTION_NAME = "device-step"
POLICY = "mixed_bfloat16"
# Llama-3.2-1B's widths (its config.json on the Hugging Face Hub): tied
# embeddings, 16 layers, grouped-query attention with 8 key/value heads.
LLAMA_1B = {
    "vocabulary_size": 128256,
    "num_layers": 16,
    "num_query_heads": 32,
    "num_key_value_heads": 8,
    "hidden_dim": 2048,
    "intermediate_dim": 8192,
    "rope_max_wavelength": 500000,
    "tie_word_embeddings": True,
}
BATCH = 8
SEQUENCE = 2048
WARMUP_STEPS = 3
TIMED_STEPS = 10
# The profile of a GPU, by words in its `device_kind`.
PROFILE_BY_KIND = (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb"))
# The committed runs: (JSON, extra arguments of the measuring command).
RUNS = (
    ("benchmarks/device_results/nvidia_h200.json", ""),
    ("benchmarks/device_results/nvidia_h200_batch32.json", " --batch 32"),
    (
        "benchmarks/device_results/nvidia_h200_batch32_budget64gib.json",
        " --batch 32 --budget 64GiB",
    ),
    (
        "benchmarks/device_results/nvidia_h200_batch32_budget32gib.json",
        " --batch 32 --budget 32GiB",
    ),
    (
        "benchmarks/device_results/nvidia_h200_batch128_budget48gib.json",
        " --batch 128 --budget 48GiB",
    ),
    (
        "benchmarks/device_results/nvidia_h200_batch256_budget64gib.json",
        " --batch 256 --budget 64GiB",
    ),
)
RESULTS = tuple(path for path, _ in RUNS)
MEASURE_COMMANDS = tuple(
    f"python -m benchmarks.device_step --json {path}{extra}" for path, extra in RUNS
)
RENDER_COMMAND = (
    f"python -m benchmarks.device_step --render {' '.join(RESULTS)} "
    "--output BENCHMARKS.md"
)


def profile_for(device_kind: str) -> str:
    """The hardware profile's name for a JAX `device_kind`.

    Args:
        device_kind: E.g. `"NVIDIA H200"`.

    Returns:
        The profile's name.

    Raises:
        SystemExit: no profile matches (pass `--hardware`).
    """
    for words, name in PROFILE_BY_KIND:
        if words in device_kind:
            return name
    raise SystemExit(
        f"No hardware profile for the device {device_kind!r}: pass --hardware NAME."
    )


def _builder(config: dict[str, Any]):
    def build():
        import keras_hub

        return keras_hub.models.LlamaBackbone(**config, dtype=POLICY)

    return build


def _sample(config: dict[str, Any], batch: int, sequence: int):
    """`(x, y)` as `jax.ShapeDtypeStruct`s: tokens and the MSE target."""
    import jax
    import numpy as np

    tokens = jax.ShapeDtypeStruct((batch, sequence), np.int32)
    target = jax.ShapeDtypeStruct((batch, sequence, config["hidden_dim"]), np.float32)
    return {"token_ids": tokens, "padding_mask": tokens}, target


def _random_batch(config: dict[str, Any], batch: int, sequence: int):
    """Real arrays of the sample's shapes (on the host)."""
    import numpy as np

    generator = np.random.default_rng(0)
    tokens = generator.integers(
        0, config["vocabulary_size"], (batch, sequence), dtype=np.int32
    )
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    y = generator.standard_normal(
        (batch, sequence, config["hidden_dim"]), dtype=np.float32
    )
    return x, y


def _versions() -> dict[str, str]:
    import importlib.metadata

    found = {"python": platform.python_version()}
    for name in (
        "jax",
        "jaxlib",
        "jax-cuda13-plugin",
        "jax-cuda12-plugin",
        "keras",
        "keras-hub",
    ):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _write(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as file:
        json.dump(result, file, indent=1)


def _phase(result: dict[str, Any], name: str, path: str, work) -> Any:
    """Run one phase; its figures (or its error) go into `result[name]`,
    written out at once so a later failure keeps them."""
    start = time.perf_counter()
    try:
        value = work()
    except Exception as error:  # recorded, not hidden: the JSON names it
        result[name] = {
            "error": f"{type(error).__name__}: {error}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
        _write(result, path)
        _log(f"{name}: FAILED: {type(error).__name__}: {error}")
        return None
    seconds = time.perf_counter() - start
    if isinstance(value, dict):
        result[name] = dict(value, seconds=seconds)
    _write(result, path)
    _log(f"{name}: done in {seconds:.1f} s")
    return value


def measure(
    path: str,
    hardware: str | None,
    config: dict[str, Any],
    batch: int,
    sequence: int,
    warmup_steps: int = WARMUP_STEPS,
    timed_steps: int = TIMED_STEPS,
    run: bool = True,
    budget: str | None = None,
) -> dict[str, Any]:
    """Plan, compile deviceless, then run on the first device; write JSON.

    Args:
        path: The JSON file written (after each phase).
        hardware: The profile's name; `None`: the first device's.
        config: `LlamaBackbone` arguments.
        batch: Global batch (sequences).
        sequence: Tokens per sequence.
        warmup_steps: Untimed calls of the train step first.
        timed_steps: Timed calls.
        run: Whether to build the model on the device and run its step
            (`False`: plan and compile deviceless only).
        budget: The plan's per-device memory budget (`memory_budget=`,
            e.g. `"48GiB"`); `None`: the profile's usable memory.

    Returns:
        The figures (as written).
    """
    import jax

    device = jax.devices()[0]
    profile = hardware or profile_for(device.device_kind)
    builder = _builder(config)
    x, y = _sample(config, batch, sequence)
    result: dict[str, Any] = {
        "gpu": {"kind": device.device_kind, "platform": device.platform},
        "versions": _versions(),
        "profile": profile,
        "model": {
            "class": "LlamaBackbone",
            "config": config,
            "policy": POLICY,
            "batch": batch,
            "sequence": sequence,
        },
        "budget": budget,
        "steps": {"warmup": warmup_steps, "timed": timed_steps},
    }
    _write(result, path)
    plans: list = []
    _phase(result, "plan", path, lambda: _plan(builder, x, profile, plans, budget))
    if device.platform != "cpu":
        # The same request planned where JAX sees only the host's CPU (as
        # on a machine without a GPU): Keras may trace another attention.
        host_plans: list = []
        _phase(
            result,
            "plan_on_host_cpu",
            path,
            lambda: _plan_in_cpu_process(
                config, batch, sequence, profile, host_plans, budget
            ),
        )
        plans = plans or host_plans
    if not plans:
        return result
    sharding_plan = plans[0]
    _phase(
        result,
        "deviceless",
        path,
        lambda: _compile_deviceless(builder, sharding_plan, (x, y), profile),
    )
    if not run:
        return result
    _phase(
        result,
        "on_device",
        path,
        lambda: _run_on_device(
            builder,
            sharding_plan,
            _random_batch(config, batch, sequence),
            device,
            warmup_steps,
            timed_steps,
        ),
    )
    return result


def _plan(
    builder, x, profile: str, plans: list, budget: str | None = None
) -> dict[str, Any]:
    """Plan for a 1x1 mesh under `profile` (and `budget`, if given); the
    plan is appended to `plans`, its figures returned."""
    from keras_autoshard import MeshSpec
    from keras_autoshard.planner.plan_request import PlanRequest
    from keras_autoshard.planner.planner import plan_with_cost

    result = plan_with_cost(
        builder,
        MeshSpec((1, 1), ("batch", "model")),
        x,
        PlanRequest(hardware=profile, memory_budget=budget),
    )
    sharding_plan = result.plan
    plans.append(sharding_plan)
    estimate = sharding_plan.estimate
    return {
        "estimate": estimate.to_dict(),
        "rematerialized": len(sharding_plan.rematerialize),
        "accumulation": sharding_plan.gradient_accumulation_steps,
        "notes": [str(note) for note in sharding_plan.notes][:20],
    }


def _plan_in_cpu_process(
    config: dict[str, Any],
    batch: int,
    sequence: int,
    profile: str,
    plans: list,
    budget: str | None = None,
) -> dict[str, Any]:
    """`_plan` in a child process with `JAX_PLATFORMS=cpu`."""
    import subprocess
    import tempfile

    from keras_autoshard import ShardingPlan

    with tempfile.TemporaryDirectory() as directory:
        plan_path = os.path.join(directory, "plan.json")
        command = [
            sys.executable, "-m", "benchmarks.device_step",
            "--plan-child", plan_path, "--hardware", profile,
            "--config", json.dumps(config),
            "--batch", str(batch), "--sequence", str(sequence),
        ] + (["--budget", budget] if budget else [])  # fmt: skip
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:])
        plans.append(ShardingPlan.load(plan_path))
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compile_deviceless(builder, sharding_plan, sample, profile: str):
    from keras_autoshard.apply.jax.target_compile import compile_for_target

    compiled = compile_for_target(builder, sharding_plan, sample, profile)
    return {
        "compiled_peak_bytes": compiled.compiled_peak_bytes,
        "memory": dict(compiled.step.memory),
        "compile_s": compiled.compile_s,
    }


def _run_on_device(
    builder, sharding_plan, data, device, warmup_steps: int, timed_steps: int
):
    import jax
    import keras

    from keras_autoshard import PlanDistribution
    from keras_autoshard.apply.as_planned import (
        compile_as_planned,
        compiler_options_for,
        first_micro_batch,
    )
    from keras_autoshard.report.compiled_program import (
        step_report,
        train_step_program,
    )

    mesh = keras.distribution.DeviceMesh(
        shape=sharding_plan.mesh.shape,
        axis_names=list(sharding_plan.mesh.axis_names),
        devices=[device],
    )
    distribution = PlanDistribution(sharding_plan, device_mesh=mesh)
    with distribution.scope():
        model = builder()
        compile_as_planned(model, sharding_plan)
    parameters = sum(math.prod(v.shape) for v in model.trainable_variables)
    step, (state, batch) = train_step_program(
        model, distribution, first_micro_batch(sharding_plan, data)
    )
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile(
        compiler_options=compiler_options_for(sharding_plan)
    )
    compile_s = time.perf_counter() - start
    report = step_report("train_step", compiled, sharding_plan.mesh)
    hlo = report.hlo_text
    attention = [
        target for target in ("__cudnn$fmha", "cudnn", "flash") if target in hlo
    ]
    del model  # its variables' buffers are the state, donated below
    resident_before = (device.memory_stats() or {}).get("bytes_in_use")
    seconds = []
    losses = []
    for index in range(warmup_steps + timed_steps):
        start = time.perf_counter()
        logs, state = compiled(state, batch)
        jax.block_until_ready((logs, state))
        if index >= warmup_steps:
            seconds.append(time.perf_counter() - start)
        losses.append(float(jax.tree.leaves(logs)[0]))
    stats = device.memory_stats() or {}
    calls = sharding_plan.gradient_accumulation_steps
    return {
        "parameters": parameters,
        "compile_s": compile_s,
        "compiled_peak_bytes": _compiled_peak(report.memory),
        "memory": dict(report.memory),
        "attention_custom_calls": attention,
        "call_seconds": seconds,
        "median_call_s": statistics.median(seconds),
        "optimizer_step_s": statistics.median(seconds) * calls,
        "calls_per_optimizer_step": calls,
        "losses": losses,
        "bytes_in_use_before_steps": resident_before,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "bytes_limit": stats.get("bytes_limit"),
    }


def _compiled_peak(memory: dict[str, int]) -> int:
    from keras_autoshard.report.estimate_check import compiled_peak_bytes

    return compiled_peak_bytes(memory)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.device_step", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", help="measure here (a GPU), write the figures")
    parser.add_argument("--render", nargs="+", help="JSON files `--json` wrote")
    parser.add_argument("--output", help="Markdown file whose section to rewrite")
    parser.add_argument("--hardware", help="profile name (default: the device's)")
    parser.add_argument("--layers", type=int, help="fewer layers (a quick check)")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--sequence", type=int, default=SEQUENCE)
    parser.add_argument("--vocabulary", type=int, help="a smaller vocabulary")
    parser.add_argument("--hidden", type=int, help="a narrower model (quick check)")
    parser.add_argument(
        "--budget", help="per-device memory budget for the plan (e.g. 48GiB)"
    )
    parser.add_argument(
        "--no-run", action="store_true", help="plan and compile deviceless only"
    )
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--plan-child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    config = json.loads(args.config) if args.config else dict(LLAMA_1B)
    if args.layers:
        config["num_layers"] = args.layers
    if args.vocabulary:
        config["vocabulary_size"] = args.vocabulary
    if args.hidden:
        config["hidden_dim"] = args.hidden
        config["intermediate_dim"] = 4 * args.hidden
    if args.plan_child:
        plans: list = []
        x, _ = _sample(config, args.batch, args.sequence)
        figures = _plan(_builder(config), x, args.hardware, plans, args.budget)
        plans[0].save(args.plan_child)
        print(json.dumps(figures))
        return
    if args.json:
        result = measure(
            args.json,
            args.hardware,
            config,
            args.batch,
            args.sequence,
            run=not args.no_run,
            budget=args.budget,
        )
        results = [result]
    elif args.render:
        results = []
        for path in args.render:
            with open(path) as file:
                results.append(json.load(file))
    else:
        raise SystemExit("Pass --json PATH (measure) or --render PATH ...")
    if all("estimate" in r.get("plan", r.get("plan_on_host_cpu", {})) for r in results):
        from benchmarks.device_step_report import render

        section = render(results)
        print(section)
        if args.output:
            from keras_autoshard.testing.markdown import write_section

            write_section(args.output, SECTION_NAME, section)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
