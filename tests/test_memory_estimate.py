"""The plan's estimated peak per device agrees with the compiled train step.

For every model of the zoo on meshes 2x4, 1x8 and 8x1, `plan.estimate`
(parameters, gradients, optimizer slots, the activations the backward pass
keeps, inputs and targets, transient buffers) is compared with XLA's memory
analysis of the jitted Keras train step under the plan (arguments + outputs
+ temporaries − aliased, state donated): within ±15 %, without and with
every repeated layer rematerialized (`rematerialize="all"`), and under
`mixed_bfloat16`. Train steps are compiled as accelerators compile them:
scheduled for memory, with their optimization barriers kept
(`MEMORY_SCHEDULE_ON_CPU`; XLA:CPU's defaults order a program for
throughput).
"""

import keras
import pytest

from benchmarks import zoo
from benchmarks.measure import compiled_as_planned
from keras_autoshard import (
    MeshSpec,
    PlanDistribution,
    plan,
)
from keras_autoshard.report.compiled_program import (
    MEMORY_SCHEDULE_ON_CPU,
    inspect_compiled,
    inspect_forward,
)
from keras_autoshard.report.estimate_check import compiled_peak_bytes
from keras_autoshard.report.hlo.schedules import schedule_peaks

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
    report = inspect_compiled(model, distribution, (x, y), MEMORY_SCHEDULE_ON_CPU)
    compiled = compiled_peak_bytes(report.train_step.memory)
    estimate = sharding_plan.estimate
    ratio = estimate.peak_bytes / compiled
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{name} on {shape}: estimated {estimate.peak_bytes} bytes "
        f"({estimate.to_dict()}), compiled {compiled} (ratio {ratio:.2f})"
    )
    # The JSON keeps it.
    assert type(sharding_plan).from_json(sharding_plan.to_json()).estimate == estimate


# Zoo models with a repeated-layer family to rematerialize.
REMAT_ZOO = ["bert", "gemma", "gpt2", "llama", "opt", "subclassed"]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", REMAT_ZOO)
def test_estimated_peak_with_every_layer_rematerialized(name, shape):
    build, batch = zoo.ZOO[name]
    x = batch()
    y = zoo.random_targets(build, x)
    mesh = MeshSpec(shape, ("batch", "model"))
    sharding_plan = plan(build, mesh, x, rematerialize="all")
    assert len(sharding_plan.rematerialize) >= 2
    assert any(
        note.startswith("Estimated peak") and "(asked for)" in note
        for note in sharding_plan.notes
    ), sharding_plan.notes
    free = plan(build, mesh, x)
    assert sharding_plan.estimate.peak_bytes < free.estimate.peak_bytes
    report = compiled_as_planned(
        sharding_plan, build, x, y, compiler_options=MEMORY_SCHEDULE_ON_CPU
    )
    compiled = compiled_peak_bytes(report.train_step.memory)
    ratio = sharding_plan.estimate.peak_bytes / compiled
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{name} on {shape} with {sharding_plan.rematerialize} rematerialized: "
        f"estimated {sharding_plan.estimate.to_dict()}, compiled {compiled} "
        f"(ratio {ratio:.2f})"
    )
    # The same instructions replayed in the order XLA:GPU's memory scheduler
    # would keep (least of list, depth-first, post order). The replay shares
    # no buffers, so it can read below XLA's own peak: the estimate over it
    # measured 0.86-1.19 (BENCHMARKS.md "memory truth"; the subclassed
    # model on 8x1 and under mixed_bfloat16 at 1.16 and 1.19).
    peaks = schedule_peaks(report.train_step.hlo_text)
    least_ratio = sharding_plan.estimate.peak_bytes / peaks.least
    assert 1 - TOLERANCE <= least_ratio <= 1.2, (name, shape, peaks, least_ratio)


# Under mixed_bfloat16 (bfloat16 activations, float32 variables) XLA:CPU
# computes in float32: the estimate keeps the bfloat16 operands of matrix
# products at 4 bytes (XLA keeps their float32 copies, kernel casts among
# them) and other bfloat16 residuals at 2 (`cost_model.kept_widening`).
# Measured on 2x4 from 0.96 (bert, mlp) to 1.10 (llama, subclassed); with
# the earlier estimate (XLA:CPU's default schedule), counting every bfloat16
# residual at 4 bytes put llama at 1.17 and gemma at 1.14.


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_estimated_peak_under_mixed_bfloat16(name):
    build, batch = zoo.ZOO[name]
    x = batch()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        y = zoo.random_targets(build, x)
        sharding_plan = plan(build, MeshSpec((2, 4), ("batch", "model")), x)
        distribution = PlanDistribution(sharding_plan)
        with distribution.scope():
            model = build()
            model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
        report = inspect_compiled(model, distribution, (x, y), MEMORY_SCHEDULE_ON_CPU)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    compiled = compiled_peak_bytes(report.train_step.memory)
    ratio = sharding_plan.estimate.peak_bytes / compiled
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{name} under mixed_bfloat16: estimated "
        f"{sharding_plan.estimate.to_dict()}, compiled {compiled} "
        f"(ratio {ratio:.2f})"
    )


# Inference (`predict`): parameters, inputs, the predictions and twice the
# largest activation of the batch or once the largest made from weights
# alone (the tied model's gathered, transposed table on 8x1: counted twice,
# it was estimated 1.47x). The zoo's transformers, MLP and tied model on
# every mesh; left out, measured: the CNN on 1x8 (estimate 1.91 of the compiled
# forward step: XLA:CPU fuses its convolutions' outputs away, the estimate
# keeps two of them) and the subclassed model (0.75 on 2x4, 0.79 on 1x8).
INFERENCE_ZOO = ["bert", "gpt2", "llama", "mlp", "tied"]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", INFERENCE_ZOO)
def test_inference_estimate_is_within_15_percent_of_the_compiled_forward_step(
    name, shape
):
    build, batch = zoo.ZOO[name]
    x = batch()
    sharding_plan = plan(build, MeshSpec(shape, ("batch", "model")), x, job="inference")
    distribution = PlanDistribution(sharding_plan)
    with distribution.scope():
        model = build()
    step = inspect_forward(model, distribution, x)
    compiled = compiled_peak_bytes(step.memory)
    estimate = sharding_plan.estimate
    ratio = estimate.peak_bytes / compiled
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{name} on {shape}: estimated {estimate.peak_bytes} bytes "
        f"({estimate.to_dict()}), compiled {compiled} (ratio {ratio:.2f})"
    )
