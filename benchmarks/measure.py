"""Measure one (model, strategy) case: compiled collectives, bytes, step time."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any

import keras
import numpy as np
from keras.src.distribution.distribution_lib import Distribution

from benchmarks.models import ModelCase
from benchmarks.strategies import Strategy
from keras_autoshard import MeshSpec, inspect_compiled
from keras_autoshard.testing.reference_plans import StrategyNotApplicable

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
