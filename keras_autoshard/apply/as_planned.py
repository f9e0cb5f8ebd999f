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
    steps = sharding_plan.gradient_accumulation_steps
    optimizer = keras.optimizers.Adam(
        gradient_accumulation_steps=steps if steps > 1 else None
    )
    model.compile(optimizer=optimizer, loss=loss)


def first_micro_batch(sharding_plan: ShardingPlan, data: Any) -> Any:
    """The first of the plan's micro-batches of `data` (all of it when the
    plan does not accumulate gradients): what one compiled step takes.

    Args:
        sharding_plan: The plan.
        data: A structure of arrays with the global batch first.

    Returns:
        The same structure, each array's first `1/steps` of the batch.
    """
    parts = sharding_plan.gradient_accumulation_steps
    return keras.tree.map_structure(lambda a: a[: a.shape[0] // parts], data)


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
