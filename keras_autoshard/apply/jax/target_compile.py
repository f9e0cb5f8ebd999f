"""Compile a plan's train step for GPUs that are not here, with no weights.

The model is built abstractly (variables with shapes, no values), its
optimizer's slots too; the step Keras's `fit` jits (`model.train_step`, the
state donated, the plan's layouts as output shardings) is lowered from
`jax.ShapeDtypeStruct`s carrying the plan's shardings over a topology of the
target's GPUs (`runtime/gpu_targets`), and XLA:GPU compiles it ahead of
time. Nothing the size of a weight is allocated anywhere: a Llama-2-70B plan
for 256 H100s compiles on a laptop. What comes back is what the compiler
made: its memory analysis and its collectives.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np
from rich.console import Console

from keras_autoshard.apply.as_planned import first_micro_batch, planned_optimizer
from keras_autoshard.apply.jax.plan_distribution import (
    PlanDistribution,
    require_jax_backend,
)
from keras_autoshard.apply.remat import rematerialize
from keras_autoshard.compat import keras_private
from keras_autoshard.errors import PlanError
from keras_autoshard.plans.hardware import HardwareProfile, hardware_profile
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan
from keras_autoshard.plans.units import format_bytes
from keras_autoshard.report.compiled_program import step_report
from keras_autoshard.report.compiled_report import (
    CompiledStep,
    collective_table,
    memory_line,
)
from keras_autoshard.report.estimate_check import compiled_peak_bytes
from keras_autoshard.runtime.gpu_targets import gpu_topology
from keras_autoshard.trace.tracer import abstract_variables, build_abstract


@dataclasses.dataclass(frozen=True)
class TargetCompile:
    """A plan's train step as XLA:GPU compiled it for a target.

    Args:
        target: The hardware profile's name.
        mesh: The plan's mesh (its device count is the GPUs compiled for).
        step: The compiled step: memory analysis, collectives, HLO text.
        parameter_bytes_per_device: The model's variables on one GPU, as the
            plan's shardings place them.
        optimizer_bytes_per_device: The optimizer's variables on one GPU.
        estimated_peak_bytes: The plan's estimated peak per device.
        compile_s: Seconds XLA:GPU took (lowering excluded).

    Example:

    ```python
    result = compile_for_target(build, plan, (x, y), "h100-80gb")
    print(result.table())
    result.step.operand_bytes("reduce-scatter", mesh_axes=("batch",))
    ```
    """

    target: str
    mesh: MeshSpec
    step: CompiledStep
    parameter_bytes_per_device: int
    optimizer_bytes_per_device: int
    estimated_peak_bytes: int | None
    compile_s: float

    @property
    def device_count(self) -> int:
        """GPUs compiled for."""
        return self.mesh.device_count

    @property
    def compiled_peak_bytes(self) -> int:
        """Arguments + outputs + temporaries − aliased, per device."""
        return compiled_peak_bytes(self.step.memory)

    @property
    def estimate_ratio(self) -> float | None:
        """Estimated over compiled peak (`None` without an estimate)."""
        if self.estimated_peak_bytes is None:
            return None
        return self.estimated_peak_bytes / self.compiled_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """The compile as JSON-ready data (no HLO)."""
        return {
            "target": self.target,
            "compiler": "XLA:GPU",
            "device_count": self.device_count,
            "mesh": {
                "shape": list(self.mesh.shape),
                "axis_names": list(self.mesh.axis_names),
            },
            "compile_s": self.compile_s,
            "compiled_peak_bytes": self.compiled_peak_bytes,
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "device_memory_bytes": hardware_profile(self.target).memory_bytes,
            "parameter_bytes_per_device": self.parameter_bytes_per_device,
            "optimizer_bytes_per_device": self.optimizer_bytes_per_device,
            "train_step": self.step.to_dict(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """`to_dict()` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        """The compile as text: what was compiled for what, the collectives
        per mesh axis, XLA's memory analysis and the peak per device."""
        memory_bytes = hardware_profile(self.target).memory_bytes
        buffer = io.StringIO()
        console = Console(file=buffer, width=160, color_system=None)
        console.print(
            f"Train step compiled by XLA:GPU for {self.device_count} {self.target} "
            f"GPUs (mesh {self.mesh.describe()}) in {self.compile_s:.1f} s, ahead "
            "of time, no weights allocated.",
            soft_wrap=True,
        )
        console.print(
            f"Parameters {format_bytes(self.parameter_bytes_per_device)}/device, "
            f"optimizer state {format_bytes(self.optimizer_bytes_per_device)}/device"
        )
        console.print(collective_table(self.step))
        console.print(memory_line(self.step))
        peak = (
            f"Compiled peak per device {format_bytes(self.compiled_peak_bytes)} of "
            f"the {self.target}'s {format_bytes(memory_bytes)}"
        )
        if self.compiled_peak_bytes > memory_bytes:
            peak += " (DOES NOT FIT)"
        if self.estimated_peak_bytes is not None:
            peak += (
                f"; the plan estimated {format_bytes(self.estimated_peak_bytes)} "
                f"(estimate / compiled {self.estimate_ratio:.2f})"
            )
        console.print(peak + ".")
        return buffer.getvalue()


def compile_for_target(
    model_builder: Callable[[], keras.Model],
    sharding_plan: ShardingPlan,
    sample_batch: Any,
    target: str | HardwareProfile,
    loss: str = "mse",
    compiler_options: dict[str, Any] | None = None,
) -> TargetCompile:
    """Compile the plan's train step for the target's GPUs, deviceless.

    Args:
        model_builder: A function with no arguments building the model (as
            for `plan`); it runs under the plan's distribution, abstractly.
        sharding_plan: The plan (its rematerialized layers and gradient
            accumulation are compiled as it says).
        sample_batch: `(x, y)` or `(x, y, sample_weight)` with the global
            batch: arrays or `jax.ShapeDtypeStruct`s (only shapes are read).
        target: A GPU hardware profile or its name (`"h100-80gb"`).
        loss: The loss to compile with.
        compiler_options: XLA:GPU options (e.g.
            `{"xla_gpu_enable_latency_hiding_scheduler": False}`).

    Returns:
        A `TargetCompile`.

    Raises:
        GpuCompilerMissingError: JAX's CUDA plugin is not installed (the
            message names the extra).
        PlanError: the target has no GPU description, or the plan's mesh
            does not match the model.

    Example:

    ```python
    result = compile_for_target(build, plan, (x, y), "h100-80gb")
    print(result.table())  # collectives per mesh axis, peak vs the estimate
    result.compiled_peak_bytes, result.estimate_ratio, result.step.collectives
    ```
    """
    require_jax_backend("compile_for_target")
    profile = hardware_profile(target)
    mesh_spec = sharding_plan.mesh
    topology = gpu_topology(profile, mesh_spec.device_count)
    device_mesh = keras.distribution.DeviceMesh(
        shape=mesh_spec.shape,
        axis_names=list(mesh_spec.axis_names),
        devices=list(topology.devices),
    )
    distribution = PlanDistribution(sharding_plan, device_mesh=device_mesh)
    with distribution.scope():
        model = build_abstract(model_builder)
        rematerialize(model, sharding_plan)
    # The optimizer's step counter and learning rate are made from values: on
    # the host, outside the distribution (whose devices hold no buffers).
    model.compile(optimizer=planned_optimizer(sharding_plan), loss=loss)
    with distribution.scope(), abstract_variables():
        model.optimizer.build(model.trainable_variables)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(tuple(sample_batch))
    batch = first_micro_batch(sharding_plan, _shape_structs((x, y, sample_weight)))
    keras_private.symbolic_build(model, data_batch=batch)

    state = _state_structs(model, distribution)
    data = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(
            leaf.shape,
            leaf.dtype,
            sharding=distribution.get_data_layout(leaf.shape).backend_layout,
        ),
        batch,
    )
    shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
    with distribution.scope():
        step = jax.jit(
            model.train_step, donate_argnums=0, out_shardings=(None, shardings)
        )
        lowered = step.lower(state, data)
        start = time.perf_counter()
        compiled = lowered.compile(compiler_options=compiler_options)
        compile_s = time.perf_counter() - start
    estimate = sharding_plan.estimate
    trainable, non_trainable, optimizer, _ = state
    return TargetCompile(
        target=profile.name,
        mesh=mesh_spec,
        step=step_report("train_step", compiled, mesh_spec),
        parameter_bytes_per_device=_bytes_per_device(trainable + non_trainable),
        optimizer_bytes_per_device=_bytes_per_device(optimizer),
        estimated_peak_bytes=None if estimate is None else estimate.peak_bytes,
        compile_s=compile_s,
    )


def _bytes_per_device(structs) -> int:
    """Bytes of one device's shards of sharded `ShapeDtypeStruct`s (the
    largest shard of an uneven split)."""
    return sum(
        math.prod(struct.sharding.shard_shape(struct.shape))
        * np.dtype(struct.dtype).itemsize
        for struct in structs
    )


def _shape_structs(tree):
    """Every array-like leaf as a `jax.ShapeDtypeStruct` (no sharding)."""

    def struct(leaf):
        if leaf is None:
            return None
        dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
        return jax.ShapeDtypeStruct(tuple(leaf.shape), dtype)

    return jax.tree.map(struct, tree)


def _state_structs(model: keras.Model, distribution: PlanDistribution):
    """`(trainable, non_trainable, optimizer, metrics)` as the JAX trainer
    passes its step, each variable a `ShapeDtypeStruct` with its planned
    sharding; an optimizer slot takes its parameter's."""
    mesh = distribution.device_mesh.backend_mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def planned(variable):
        layout = distribution.get_variable_layout(variable)
        return layout.backend_layout if layout is not None else replicated

    def struct(variable, sharding):
        dtype = keras.backend.standardize_dtype(variable.dtype)
        return jax.ShapeDtypeStruct(tuple(variable.shape), dtype, sharding=sharding)

    trainable = [struct(v, planned(v)) for v in model.trainable_variables]
    non_trainable = [struct(v, planned(v)) for v in model.non_trainable_variables]
    slot_owners = _slot_owners(model.optimizer, model.trainable_variables)
    optimizer = [
        struct(v, planned(slot_owners[id(v)]) if id(v) in slot_owners else replicated)
        for v in model.optimizer.variables
    ]
    metrics = [struct(v, replicated) for v in model.metrics_variables]
    return trainable, non_trainable, optimizer, metrics


def _slot_owners(optimizer, parameters) -> dict[int, Any]:
    """Optimizer variable id → the parameter it was made from.

    Keras names a variable made by `add_variable_from_reference`
    `<parameter path with '/' as '_'>_<slot>` (its documented pattern), with
    the parameter's shape; the longest such prefix wins (`dense_1` before
    `dense`).
    """
    by_prefix = sorted(
        ((p.path.replace("/", "_") + "_", p) for p in parameters),
        key=lambda item: -len(item[0]),
    )
    owners = {}
    for variable in optimizer.variables:
        name = variable.path.split("/", 1)[-1]
        for prefix, parameter in by_prefix:
            if name.startswith(prefix) and tuple(variable.shape) == tuple(
                parameter.shape
            ):
                owners[id(variable)] = parameter
                break
        else:
            if len(variable.shape) > 0:
                raise PlanError(
                    f"Optimizer variable {variable.path!r} {tuple(variable.shape)} "
                    "matches no parameter by Keras's slot naming "
                    "(<parameter path>_<slot>), so its sharding is unknown."
                )
    return owners
