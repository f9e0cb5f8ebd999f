"""The plan's estimated peak per device agrees with the compiled train step.

For every model of the zoo on meshes 2x4, 1x8 and 8x1, `plan.estimate`
(parameters, gradients, optimizer slots, the activations the backward pass
keeps, inputs and targets, transient buffers) is compared with XLA's memory
analysis of the jitted Keras train step under the plan (arguments + outputs
+ temporaries − aliased, state donated): within ±15 %.
"""

import keras
import pytest

from benchmarks import zoo
from keras_autoshard import MeshSpec, PlanDistribution, plan
from keras_autoshard.report.compiled_program import inspect_compiled
from keras_autoshard.report.estimate_check import compiled_peak_bytes

MESHES = [(2, 4), (1, 8), (8, 1)]
TOLERANCE = 0.15


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_estimated_peak_is_within_15_percent_of_the_compiled_step(name, shape):
    build, batch = zoo.ZOO[name]
    x = batch()
    y = zoo.random_targets(build, x)
    sharding_plan = plan(build, MeshSpec(shape, ("batch", "model")), x)
    distribution = PlanDistribution(sharding_plan)
    with distribution.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    report = inspect_compiled(model, distribution, (x, y))
    compiled = compiled_peak_bytes(report.train_step.memory)
    estimate = sharding_plan.estimate
    ratio = estimate.peak_bytes / compiled
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{name} on {shape}: estimated {estimate.peak_bytes} bytes "
        f"({estimate.to_dict()}), compiled {compiled} (ratio {ratio:.2f})"
    )
    # The JSON keeps it.
    assert type(sharding_plan).from_json(sharding_plan.to_json()).estimate == estimate
