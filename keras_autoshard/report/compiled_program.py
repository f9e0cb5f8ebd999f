"""Compile a model's train and forward steps under a distribution and report.

The step functions are the ones `model.fit` / `model.predict` jit (same
function, same donation, same output shardings), lowered and compiled here
without running them.
"""

from __future__ import annotations

import re

import jax
import keras

from keras_autoshard.compat import keras_private
from keras_autoshard.plans.sharding_plan import MeshSpec, unique_variables
from keras_autoshard.report.compiled_report import (
    CompiledReport,
    CompiledStep,
    VariableShards,
)
from keras_autoshard.report.hlo.collectives import parse_collectives

_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
}


# XLA:CPU compiles for throughput: its default scheduler ignores memory, and
# it removes optimization barriers early (`cse_barrier_expander`), so CSE
# merges a rematerialized call's recomputation back into the forward pass and
# nothing ties a rematerialized layer's gradients together
# (`apply/remat.py`). Accelerators schedule for memory and keep the barriers
# through scheduling. These compiler options make an XLA:CPU program do the
# same: its memory scheduler, and the barriers kept (XLA:CPU runs them as
# no-ops). Measured: a jax.checkpoint'ed 8-layer MLP's gradient needs 90 MiB
# of temporaries with the defaults, 22 MiB with these, 92 MiB without
# checkpointing either way. One difference stays: XLA:CPU's memory scheduler
# is depth-first from the outputs only, where XLA:GPU takes the lowest peak of
# a list, a depth-first and a post-order schedule.
MEMORY_SCHEDULE_ON_CPU = {
    "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    "xla_disable_hlo_passes": "cse_barrier_expander",
}

# The programs compiled here are read (optimized HLO, memory analysis,
# collectives), never run. XLA's backend optimization level sets how hard
# LLVM optimizes the machine code only: the HLO passes, the schedule and the
# buffer assignment are the same at every level
# (`tests/report/test_compiled_report.py` compares both), and the lowest level
# compiles faster. Not for programs that run: unoptimized machine code runs
# slower, and rounds differently (no fused multiply-adds, other reduction
# orders), which a model whose training amplifies rounding shows (the OPT
# five-step parity of `tests/planner/test_plans_end_to_end.py` moves by
# 6e-4 under a 1e-7 nudge of its weights). A caller's own
# `xla_backend_optimization_level` wins.
READ_NOT_RUN = {"xla_backend_optimization_level": 0}


def _read_not_run(compiler_options) -> dict:
    return {**READ_NOT_RUN, **(compiler_options or {})}


def inspect_compiled(
    model,
    distribution,
    sample_batch,
    compiler_options=None,
    with_forward_step: bool = True,
) -> CompiledReport:
    """Compile one train step and one forward step and report what XLA made.

    Args:
        model: A compiled `keras.Model` created under `distribution.scope()`.
        distribution: The active `keras.distribution.Distribution`.
        sample_batch: `(x, y)` or `(x, y, sample_weight)` with the global batch.
        compiler_options: XLA options for these compilations (e.g.
            `MEMORY_SCHEDULE_ON_CPU`, to read on simulated CPU devices the
            memory a step takes compiled as an accelerator compiles it),
            over `READ_NOT_RUN` (the programs are read, not run).
        with_forward_step: Also compile the forward (predict) step; False
            compiles the train step only (the report's `forward_step` is
            then None), for a caller that reads the train step alone.

    Returns:
        A `CompiledReport`.

    Example:

    ```python
    with dist.scope():
        model = build(); model.compile(optimizer="adam", loss="mse")
        report = inspect_compiled(model, dist, (x, y))
    print(report.table())
    ```
    """
    if model.optimizer is None:
        raise ValueError(
            "inspect_compiled needs a compiled model: call model.compile(...) "
            "under the distribution's scope first."
        )
    data = keras.utils.unpack_x_y_sample_weight(tuple(sample_batch))
    if getattr(distribution, "is_planned", True) is False:
        # A distribution that plans itself (AutoShardDistribution) plans on
        # this batch first: its named planning step, as fit would take it.
        distribution.prepare(model, data[0])
    with distribution.scope():
        keras_private.symbolic_build(model, data_batch=data)
        distributed = keras_private.distribute_data(data)
        step, arguments = _train_step(model, distributed)
        train = step.lower(*arguments).compile(
            compiler_options=_read_not_run(compiler_options)
        )
        forward = (
            _compile_forward_step(model, distributed[0], compiler_options)
            if with_forward_step
            else None
        )
    device_ids = [d.id for d in _mesh_devices(distribution)]
    mesh = MeshSpec(
        tuple(distribution.device_mesh.shape), distribution.device_mesh.axis_names
    )
    return CompiledReport(
        mesh=mesh,
        parameters=tuple(
            _variable_shards(v, device_ids) for v in unique_variables(model.variables)
        ),
        optimizer_state=tuple(
            _variable_shards(v, device_ids) for v in model.optimizer.variables
        ),
        train_step=step_report("train_step", train, mesh),
        forward_step=None
        if forward is None
        else step_report("forward_step", forward, mesh),
    )


def inspect_forward(model, distribution, x, compiler_options=None) -> CompiledStep:
    """Compile one forward step (as `model.predict` jits it) and report it:
    what `inspect_compiled` reports as `forward_step`, without compiling a
    train step (an inference plan's model needs no optimizer).

    Args:
        model: A built `keras.Model` created under `distribution.scope()`.
        distribution: The active `keras.distribution.Distribution`.
        x: The inputs of one global batch.
        compiler_options: XLA options for the compilation, over
            `READ_NOT_RUN`.

    Returns:
        A `CompiledStep` named `"forward_step"`.

    Example:

    ```python
    with dist.scope():
        model = build()
    step = inspect_forward(model, dist, x)
    print(step.memory["temp_bytes"])
    ```
    """
    if not model.built:
        raise ValueError(
            f"inspect_forward needs a built model: call {model.name!r} on a "
            "batch (or build it) under the distribution's scope first."
        )
    with distribution.scope():
        (distributed,) = keras_private.distribute_data((x,))
        forward = _compile_forward_step(model, distributed, compiler_options)
    mesh = MeshSpec(
        tuple(distribution.device_mesh.shape), distribution.device_mesh.axis_names
    )
    return step_report("forward_step", forward, mesh)


# An HLO instruction that is a matrix product: `%dot.3 = f32[..] dot(...)`.
_MATMUL = re.compile(r"= [^=]*? (?:dot|convolution)\(")


def train_step_program(model, distribution, sample_batch):
    """The jitted train step `model.fit` runs and its arguments (the model's
    state and the distributed batch), not lowered: to lower, compile or
    export (`jax.export`) for another platform.

    Args:
        model: A compiled `keras.Model` created under `distribution.scope()`.
        distribution: Its `keras.distribution.Distribution` (planned).
        sample_batch: `(x, y)` or `(x, y, sample_weight)` with the global batch.

    Returns:
        `(step, arguments)`: `step.lower(*arguments)` lowers it.

    Example:

    ```python
    step, arguments = train_step_program(model, distribution, (x, y))
    exported = jax.export.export(step, platforms=("cuda",))(*arguments)
    ```
    """
    data = keras.utils.unpack_x_y_sample_weight(tuple(sample_batch))
    with distribution.scope():
        keras_private.symbolic_build(model, data_batch=data)
        return _train_step(model, keras_private.distribute_data(data))


def _train_step(model, data):
    state = keras_private.jax_state(
        model,
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    step = jax.jit(
        model.train_step,
        donate_argnums=0,
        out_shardings=(None, keras_private.state_sharding_spec(model)),
    )
    return step, (state, data)


def _compile_forward_step(model, x, compiler_options=None):
    trainable, non_trainable, _, _ = keras_private.state_sharding_spec(model)

    def predict_step(state, data):
        outputs, non_trainable_values = model.predict_step(state, data)
        return outputs, (state[0], non_trainable_values)

    state = keras_private.jax_state(
        model, trainable_variables=True, non_trainable_variables=True
    )
    step = jax.jit(
        predict_step,
        donate_argnums=0,
        out_shardings=(None, (trainable, non_trainable)),
    )
    return step.lower(state, (x,)).compile(
        compiler_options=_read_not_run(compiler_options)
    )


def step_report(name: str, compiled, mesh: MeshSpec) -> CompiledStep:
    """A compiled step as plain data: its collectives (per mesh axis), XLA's
    memory analysis, its matrix products and its optimized HLO.

    Args:
        name: The step's name (`"train_step"`).
        compiled: A `jax.stages.Compiled`.
        mesh: The mesh it was compiled for.

    Returns:
        A `CompiledStep`.
    """
    hlo_text = compiled.as_text()
    collectives = parse_collectives(hlo_text, mesh.shape, mesh.axis_names)
    analysis = compiled.memory_analysis()
    memory = {
        key: int(getattr(analysis, attr))
        for key, attr in _MEMORY_FIELDS.items()
        if hasattr(analysis, attr)
    }
    return CompiledStep(
        name=name,
        collectives=tuple(collectives),
        memory=memory,
        matmuls=len(_MATMUL.findall(hlo_text)),
        flops=_flops(compiled),
        hlo_text=hlo_text,
    )


def _flops(compiled) -> float | None:
    """FLOPs per device of a compiled program, or `None` where the
    compiler's cost analysis has none."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"])


def _mesh_devices(distribution):
    return list(distribution.device_mesh.backend_mesh.devices.flat)


def _variable_shards(variable, device_ids) -> VariableShards:
    array = variable.value
    bytes_by_id = dict.fromkeys(device_ids, 0)
    for shard in array.addressable_shards:
        bytes_by_id[shard.device.id] = int(shard.data.nbytes)
    spec = tuple(array.sharding.spec) if hasattr(array.sharding, "spec") else ()
    spec = spec + (None,) * (array.ndim - len(spec))
    return VariableShards(
        path=variable.path,
        shape=tuple(int(s) for s in array.shape),
        dtype=str(array.dtype),
        spec=tuple(None if a is None else str(a) for a in spec),
        bytes_by_device=tuple(bytes_by_id[i] for i in device_ids),
    )
