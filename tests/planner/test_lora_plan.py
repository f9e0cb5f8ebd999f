"""A LoRA fine-tune is planned for what it trains.

A Gemma-shaped KerasHub backbone with `enable_lora(rank=4)`: its base
kernels become non-trainable, only the LoRA kernels train. The plan's
estimate must hold gradients and Adam's two moments for the LoRA kernels
alone (read against the addressable shards of the model's trainable
variables under the plan), and its peak must agree with the compiled train
step's (XLA memory analysis) within ±15 %.
"""

import keras
import pytest

from keras_autoshard import MeshSpec, PlanDistribution, plan
from keras_autoshard.report.compiled_program import (
    MEMORY_SCHEDULE_ON_CPU,
    inspect_compiled,
)
from keras_autoshard.report.estimate_check import compiled_peak_bytes
from keras_autoshard.testing import zoo

TOLERANCE = 0.15


def gemma_with_lora():
    model = zoo.gemma()
    model.enable_lora(rank=4)
    return model


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_lora_plan_budgets_optimizer_state_for_the_lora_kernels_only(shape):
    x = zoo.ZOO["gemma"][1]()
    y = zoo.random_targets(gemma_with_lora, x)
    mesh = MeshSpec(shape, ("batch", "model"))
    lora_plan = plan(gemma_with_lora, mesh, x)
    full_plan = plan(zoo.gemma, mesh, x)

    distribution = PlanDistribution(lora_plan)
    with distribution.scope():
        model = gemma_with_lora()
        model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    trainable = model.trainable_variables
    assert trainable and all("lora_kernel" in v.path for v in trainable)
    lora_bytes = sum(v.value.addressable_shards[0].data.nbytes for v in trainable)

    estimate = lora_plan.estimate
    assert estimate.gradient_bytes == lora_bytes
    assert estimate.optimizer_bytes == 2 * lora_bytes
    # The frozen base weights carry neither: far below the full fine-tune's.
    assert estimate.optimizer_bytes < full_plan.estimate.optimizer_bytes / 10

    report = inspect_compiled(
        model, distribution, (x, y), MEMORY_SCHEDULE_ON_CPU, with_forward_step=False
    )
    compiled = compiled_peak_bytes(report.train_step.memory)
    ratio = estimate.peak_bytes / compiled
    assert abs(ratio - 1) <= TOLERANCE, (shape, ratio, estimate.to_dict())
