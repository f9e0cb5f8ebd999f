"""A model built, compiled and inspected as its plan says.

The one sequence from a plan to XLA's report of the compiled train step:
the plan's `PlanDistribution`, the model built under it, its rematerialized
layers and micro-batches (`compile_as_planned`), then `inspect_compiled` on
one micro-batch. The tests, the benchmarks and `keras-autoshard inspect`
all compile through `compiled_as_planned`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_autoshard.apply.as_planned import compile_as_planned, first_micro_batch
from keras_autoshard.apply.jax.device_mesh import make_device_mesh
from keras_autoshard.apply.jax.plan_distribution import PlanDistribution
from keras_autoshard.plans.sharding_plan import ShardingPlan
from keras_autoshard.report.compiled_program import inspect_compiled
from keras_autoshard.report.compiled_report import CompiledReport
from keras_autoshard.trace.naming import names_replayed_after


def plan_distribution(sharding_plan: ShardingPlan) -> PlanDistribution:
    """A `PlanDistribution` of `sharding_plan` on the first devices.

    Args:
        sharding_plan: The plan.

    Returns:
        The distribution on as many devices as the plan's mesh has (a 1x4
        plan on 8 simulated devices takes the first 4).

    Example:

    ```python
    with plan_distribution(sharding_plan).scope():
        model = build()
    ```
    """
    devices = keras.distribution.list_devices()[: sharding_plan.mesh.device_count]
    return PlanDistribution(
        sharding_plan, make_device_mesh(sharding_plan.mesh, devices)
    )


def compiled_as_planned(
    sharding_plan: ShardingPlan,
    build: Callable[[], keras.Model],
    x: Any,
    y: Any,
    compiler_options: dict | None = None,
    with_forward_step: bool = False,
    distribution: PlanDistribution | None = None,
) -> CompiledReport:
    """The train step of `build()` compiled as `sharding_plan` says.

    The model is built under the plan's distribution (its names replayed
    for the next build), its planned layers rematerialized and Adam
    accumulating over the plan's micro-batches (`compile_as_planned`); the
    step is compiled on the first micro-batch of `(x, y)`.

    Args:
        sharding_plan: The plan.
        build: Builds the model (and may load its weights).
        x: One global batch of inputs.
        y: Its targets.
        compiler_options: XLA options for the compilations (see
            `inspect_compiled`).
        with_forward_step: Also compile the forward (predict) step.
        distribution: The plan's distribution; by default on the first
            devices (`plan_distribution`).

    Returns:
        The `CompiledReport` (its `forward_step` None unless asked for).

    Example:

    ```python
    report = compiled_as_planned(plan(build, mesh, x), build, x, y)
    report.train_step.operand_bytes()
    ```
    """
    if distribution is None:
        distribution = plan_distribution(sharding_plan)
    with distribution.scope(), names_replayed_after():
        model = build()
        compile_as_planned(model, sharding_plan)
    return inspect_compiled(
        model,
        distribution,
        first_micro_batch(sharding_plan, (x, y)),
        compiler_options=compiler_options,
        with_forward_step=with_forward_step,
    )


def compiled_report(
    build: Callable[[], keras.Model],
    distribution: keras.distribution.Distribution,
    x: Any,
    y: Any,
) -> CompiledReport:
    """The train step of `build()` under any distribution, compiled.

    For a layout that is not a plan (KerasHub's layout map, Keras's
    `DataParallel`): the model is built under `distribution`, compiled with
    an MSE loss and Adam on `(x, y)`, and its train step inspected.

    Args:
        build: Builds the model.
        distribution: The distribution to build and compile under.
        x: One global batch of inputs.
        y: Its targets.

    Returns:
        The `CompiledReport` of the train step.

    Example:

    ```python
    report = compiled_report(build, keras_hub_layout_map(build, mesh), x, y)
    ```
    """
    with distribution.scope(), names_replayed_after():
        model = build()
        model.compile(optimizer="adam", loss="mse")
        return inspect_compiled(model, distribution, (x, y), with_forward_step=False)
