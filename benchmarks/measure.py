"""Measure one (model, strategy) case: compiled collectives, bytes, step time."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import statistics
import time
from typing import Any

import keras
import numpy as np
from keras.src.distribution.distribution_lib import Distribution

from benchmarks.models import ModelCase
from benchmarks.strategies import Strategy, StrategyNotApplicable
from keras_autoshard import MeshSpec, inspect_compiled
from keras_autoshard.building import names_replayed_after

WARMUP_STEPS = 2
LEARNING_RATE = 1e-3

# Mesh axes of a collective as the report keys them (None: no axis subset).
AxesKey = tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one strategy costs one model.

    Args:
        model: Model name.
        strategy: Strategy name.
        device_count: Devices the strategy uses.
        collective_count: Collectives in the compiled train step.
        collective_bytes_by_axes: Per-device operand bytes of those
            collectives, by the mesh axes they span.
        parameter_bytes_per_device: Largest per-device parameter bytes.
        total_parameter_bytes: Bytes of all parameters, unsharded.
        optimizer_bytes_per_device: Largest per-device optimizer state bytes.
        step_seconds: Wall time of each timed `train_on_batch`.
    """

    model: str
    strategy: str
    device_count: int
    collective_count: int
    collective_bytes_by_axes: dict[AxesKey, int]
    parameter_bytes_per_device: int
    total_parameter_bytes: int
    optimizer_bytes_per_device: int
    step_seconds: tuple[float, ...]

    @property
    def collective_bytes(self) -> int:
        return sum(self.collective_bytes_by_axes.values())

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds)


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A strategy that does not apply to a model, and why."""

    model: str
    strategy: str
    reason: str


CaseResult = Measurement | Skipped


@dataclasses.dataclass(frozen=True)
class _Footprint:
    collective_count: int
    collective_bytes_by_axes: dict[AxesKey, int]
    parameter_bytes_per_device: int
    optimizer_bytes_per_device: int


def measure_case(
    model_name: str,
    model_case: ModelCase,
    strategy_name: str,
    strategy: Strategy,
    mesh: MeshSpec,
    timed_steps: int,
) -> CaseResult:
    """Build, compile, inspect and time one model under one strategy.

    Args:
        model_name: Name of the model, for the result.
        model_case: The model's builder, batch and minimum.
        strategy_name: Name of the strategy, for the result.
        strategy: Returns the distribution (or `None` for one device).
        mesh: The mesh given to the strategy.
        timed_steps: `train_on_batch` calls to time after the warm-up.

    Returns:
        A `Measurement`, or `Skipped` if the strategy does not apply.
    """
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    try:
        distribution = strategy(model_case.build, mesh)
    except StrategyNotApplicable as error:
        return Skipped(model_name, strategy_name, str(error))
    x, y = model_case.batch()
    with _scope(distribution):
        model = model_case.build()
        model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss="mse")
        footprint = _compiled_footprint(model, distribution, (x, y))
        step_seconds = time_train_steps(model, x, y, timed_steps)
    return Measurement(
        model=model_name,
        strategy=strategy_name,
        device_count=_device_count(distribution),
        collective_count=footprint.collective_count,
        collective_bytes_by_axes=footprint.collective_bytes_by_axes,
        parameter_bytes_per_device=footprint.parameter_bytes_per_device,
        total_parameter_bytes=_total_parameter_bytes(model),
        optimizer_bytes_per_device=footprint.optimizer_bytes_per_device,
        step_seconds=step_seconds,
    )


def time_train_steps(
    model: keras.Model, x: Any, y: np.ndarray, timed_steps: int
) -> tuple[float, ...]:
    """Wall seconds of `timed_steps` `train_on_batch` calls after a warm-up.

    `train_on_batch` returns the loss as a NumPy value, so each call waits for
    its step to finish.
    """
    for _ in range(WARMUP_STEPS):
        model.train_on_batch(x, y)
    durations = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        durations.append(time.perf_counter() - start)
    return tuple(durations)


def _compiled_footprint(
    model: keras.Model, distribution: Distribution | None, batch: tuple
) -> _Footprint:
    if distribution is None:
        return _single_device_footprint(model)
    report = inspect_compiled(model, distribution, batch, with_forward_step=False)
    by_axes: dict[AxesKey, int] = {}
    for op in report.train_step.collectives:
        by_axes[op.mesh_axes] = by_axes.get(op.mesh_axes, 0) + op.operand_bytes
    return _Footprint(
        collective_count=report.train_step.count(),
        collective_bytes_by_axes=by_axes,
        parameter_bytes_per_device=report.parameter_bytes_per_device,
        optimizer_bytes_per_device=report.optimizer_bytes_per_device,
    )


def _single_device_footprint(model: keras.Model) -> _Footprint:
    """One device holds everything and communicates nothing."""
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return _Footprint(
        collective_count=0,
        collective_bytes_by_axes={},
        parameter_bytes_per_device=_total_parameter_bytes(model),
        optimizer_bytes_per_device=_variable_bytes(model.optimizer.variables),
    )


def _total_parameter_bytes(model: keras.Model) -> int:
    unique = {id(v): v for v in model.variables}.values()
    return _variable_bytes(unique)


def _variable_bytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def _device_count(distribution: Distribution | None) -> int:
    if distribution is None:
        return 1
    return int(np.prod(distribution.device_mesh.shape))


def _scope(distribution: Distribution | None):
    if distribution is None:
        return contextlib.nullcontext()
    return distribution.scope()


def compiled_report(build, distribution: Distribution, x, y):
    """Build `build()` under `distribution`, compile an MSE/Adam train step on
    `(x, y)` and return what XLA made of it (`inspect_compiled`, the train
    step only)."""
    with distribution.scope(), names_replayed_after():
        model = build()
        model.compile(optimizer="adam", loss="mse")
        return inspect_compiled(model, distribution, (x, y), with_forward_step=False)


def plan_distribution(sharding_plan):
    """A `PlanDistribution` of `sharding_plan` on the first devices (as many
    as its mesh has: a 1x4 plan on 8 simulated devices takes 4)."""
    from keras_autoshard import PlanDistribution, make_device_mesh

    devices = keras.distribution.list_devices()[: sharding_plan.mesh.device_count]
    return PlanDistribution(
        sharding_plan, make_device_mesh(sharding_plan.mesh, devices)
    )


def compiled_as_planned(sharding_plan, build, x, y, compiler_options=None):
    """The train step of `build()` compiled as `sharding_plan` says: its
    layout (on the first devices, `plan_distribution`), its rematerialized
    layers, its micro-batches of `(x, y)` with `gradient_accumulation_steps`
    on Adam (`compile_as_planned`); the `CompiledReport` (train step only)."""
    from keras_autoshard.apply.as_planned import compile_as_planned, first_micro_batch

    distribution = plan_distribution(sharding_plan)
    with distribution.scope(), names_replayed_after():
        model = build()
        compile_as_planned(model, sharding_plan)
    return inspect_compiled(
        model,
        distribution,
        first_micro_batch(sharding_plan, (x, y)),
        compiler_options=compiler_options,
        with_forward_step=False,
    )


def relative_error(actual, expected, scale_floor: float = 0.0) -> float:
    """max |actual - expected| / max(max |expected|, scale_floor).

    `scale_floor` keeps tensors that are analytically zero (the gradient of an
    attention key bias, say) from turning rounding noise into a huge ratio.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, scale_floor)
    diff = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    return diff / scale if scale > 0 else diff


# The KerasHub task that generates with each zoo backbone.
CAUSAL_LM = {
    "gpt2": "GPT2CausalLM",
    "opt": "OPTCausalLM",
    "gemma": "GemmaCausalLM",
    "llama": "LlamaCausalLM",
}


def compiled_generate_step(task, distribution, x):
    """Compile `task.generate_step` on the token batch `x` as KerasHub's JAX
    `generate` jits it (variables passed as state through a
    `StatelessScope`, the batch laid out by `distribution`), without
    running it."""
    import itertools

    import jax

    def generate(inputs, state):
        mapping = itertools.chain(
            zip(task.trainable_variables, state[0]),
            zip(task.non_trainable_variables, state[1]),
        )
        with keras.StatelessScope(state_mapping=mapping):
            return task.generate_step(inputs, None)

    state = (
        [v.value for v in task.trainable_variables],
        [v.value for v in task.non_trainable_variables],
    )
    inputs = {
        name: jax.device_put(
            value, distribution.get_data_layout(value.shape).backend_layout
        )
        for name, value in x.items()
    }
    return jax.jit(generate).lower(inputs, state).compile()


def executable_peak_bytes(compiled) -> int:
    """What a compiled executable needs at its peak per device, from XLA's
    memory analysis: arguments + outputs + temporaries − aliased."""
    memory = compiled.memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )


# A float32 generation cache of the zoo's batches in optimized HLO:
# (batch, layers, key and value, tokens = 64, heads, head dim).
_CACHE_BUFFER = re.compile(r"f32\[(\d+),(\d+),2,64,(\d+),(\d+)\]")


def cache_buffer_bytes(hlo_text: str) -> set[int]:
    """Bytes per device of each distinct buffer of the whole cache (every
    layer; a decode step's one-layer slices are left out) in an optimized
    HLO (empty when there is none)."""
    shapes = [tuple(int(d) for d in dims) for dims in _CACHE_BUFFER.findall(hlo_text)]
    layers = max((shape[1] for shape in shapes), default=0)
    return {4 * math.prod(shape) * 2 * 64 for shape in shapes if shape[1] == layers}


def planned_generate(name: str, shape: tuple[int, ...]):
    """Plan the zoo backbone `name`'s KerasHub CausalLM for `job="generate"`
    on a (batch, model) mesh of `shape` (the task built around an abstract
    backbone), then compile its `generate_step` as planned on the zoo's
    token batch; `(plan, compiled)`."""
    import keras_hub

    from benchmarks import zoo
    from keras_autoshard import plan
    from keras_autoshard.building import build_abstract

    task_class = getattr(keras_hub.models, CAUSAL_LM[name])
    build = getattr(zoo, name)
    x = zoo.token_inputs(1024)
    abstract = task_class(backbone=build_abstract(build), preprocessor=None)
    sharding_plan = plan(
        abstract, MeshSpec(shape, ("batch", "model")), x, job="generate"
    )
    distribution = plan_distribution(sharding_plan)
    with distribution.scope(), names_replayed_after():
        task = task_class(backbone=build(), preprocessor=None)
        task.compile(sampler="greedy")
        compiled = compiled_generate_step(task, distribution, x)
    return sharding_plan, compiled
