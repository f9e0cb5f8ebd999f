"""Compile a model as its plan says, for reading the compiled program.

A plan's estimate counts its levers: the layers it rematerializes, the
micro-batches it accumulates gradients over. A compiled step checked
against that estimate must use them too, or a rematerialized plan's
estimate is compared with a program that keeps every activation. On
XLA:CPU, whose default pipeline ignores memory when it orders a program
and merges a rematerialized call's recomputation back into the forward
pass, a train step is compiled scheduled for memory with its optimization
barriers kept (`MEMORY_SCHEDULE_ON_CPU`), as accelerators compile it.
"""

from __future__ import annotations

from typing import Any

import jax
import keras

from keras_autoshard.apply.remat import rematerialize
from keras_autoshard.plans.sharding_plan import ShardingPlan
from keras_autoshard.report.compiled_program import MEMORY_SCHEDULE_ON_CPU


def compile_as_planned(
    model: keras.Model, sharding_plan: ShardingPlan, loss: str = "mse"
) -> None:
    """Rematerialize the layers the plan names and compile with Adam,
    accumulating gradients over the plan's micro-batches.

    Args:
        model: The model, built under the plan's distribution.
        sharding_plan: Its plan.
        loss: The loss to compile with.

    Example:

    ```python
    with distribution.scope():
        model = build()
        compile_as_planned(model, sharding_plan)
    ```
    """
    rematerialize(model, sharding_plan)
    model.compile(optimizer=planned_optimizer(sharding_plan), loss=loss)


def planned_optimizer(sharding_plan: ShardingPlan) -> keras.optimizers.Optimizer:
    """Adam, accumulating gradients over the plan's micro-batches.

    Args:
        sharding_plan: The plan.

    Returns:
        An unbuilt `keras.optimizers.Adam`.
    """
    steps = sharding_plan.gradient_accumulation_steps
    return keras.optimizers.Adam(
        gradient_accumulation_steps=steps if steps > 1 else None
    )


def first_micro_batch(sharding_plan: ShardingPlan, data: Any) -> Any:
    """The first of the plan's micro-batches of `data` (all of it when the
    plan does not accumulate gradients): what one compiled step takes.

    Args:
        sharding_plan: The plan.
        data: A structure of arrays (or `jax.ShapeDtypeStruct`s) with the
            global batch first.

    Returns:
        The same structure, each array's first `1/steps` of the batch.
    """
    parts = sharding_plan.gradient_accumulation_steps

    def first(array):
        if array is None:
            return None
        if isinstance(array, jax.ShapeDtypeStruct):
            shape = (array.shape[0] // parts, *array.shape[1:])
            return jax.ShapeDtypeStruct(shape, array.dtype)
        return array[: array.shape[0] // parts]

    return keras.tree.map_structure(first, data)


def compiler_options_for(sharding_plan: ShardingPlan) -> dict[str, str] | None:
    """`MEMORY_SCHEDULE_ON_CPU` for a training plan compiled on XLA:CPU
    (whose defaults order a program for throughput and merge a
    recomputation away); `None` else (accelerators schedule for memory).

    Args:
        sharding_plan: The plan.

    Returns:
        XLA compiler options, or `None` for the defaults.
    """
    import jax

    estimate = sharding_plan.estimate
    training = estimate is None or estimate.job == "train"
    if training and jax.default_backend() == "cpu":
        return dict(MEMORY_SCHEDULE_ON_CPU)
    return None
