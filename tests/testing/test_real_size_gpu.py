"""The real-size XLA:GPU measurement's logic, on a small model: the plan
of a shallower model is the full plan's, the planner estimates that same
plan, lines through the compiled peaks extrapolate, and throughput counts
the whole batch (`keras_autoshard/testing/reduced_depth.py`,
`real_size_models.py`). The compiles themselves run only in the benchmark
(`benchmarks/real_size_gpu.py`, whose rows and section are checked in
`benchmarks/tests/test_real_size_section.py`)."""

import math

import jax
import keras_hub
import numpy as np
import pytest

import keras_autoshard as ka
from keras_autoshard.planner.plan_request import PlanRequest
from keras_autoshard.planner.planner import plan_with_cost
from keras_autoshard.testing.real_size_models import TARGET, tokens_per_s_per_gpu
from keras_autoshard.testing.reduced_depth import (
    fit_linear,
    pinned_estimate,
    restricted_plan,
)

MESH = ka.MeshSpec((2, 4), ("batch", "model"))
BATCH, SEQ, HIDDEN = 8, 64, 128
# Stored cut over the batch axis (FSDP), as real-size plans store them.
FSDP_KERNELS = ("self_attention/query/kernel", "feedforward_gate_dense/kernel")


def llama(num_layers):
    def build():
        return keras_hub.models.LlamaBackbone(
            vocabulary_size=256,
            num_layers=num_layers,
            num_query_heads=8,
            num_key_value_heads=4,
            hidden_dim=HIDDEN,
            intermediate_dim=256,
            dtype="mixed_bfloat16",
        )

    return build


def tokens():
    struct = jax.ShapeDtypeStruct((BATCH, SEQ), np.int32)
    return {"token_ids": struct, "padding_mask": struct}


@pytest.fixture(scope="module")
def full_plan():
    """A 4-layer plan rematerializing two layers in 2 micro-batches, storing
    weights cut as real-size plans do: kernels' embed dim over "batch",
    LayerNorm scales over "model" (FSDP)."""
    planned = ka.plan(
        llama(4),
        MESH,
        tokens(),
        hardware=TARGET,
        rematerialize=["transformer_layer_1", "transformer_layer_3"],
        gradient_accumulation_steps=2,
    )
    cut = {}
    for variable in planned.variables:
        if variable.path.endswith(FSDP_KERNELS):
            assert variable.spec[0] is None
            cut[variable.path] = ("batch",) + tuple(variable.spec[1:])
        elif variable.path.endswith("layernorm/scale"):
            assert variable.spec == (None,)
            cut[variable.path] = ("model",)
    assert len(cut) == 4 * len(FSDP_KERNELS) + 2 * 4 + 1
    return planned.replace_specs(cut, reason="FSDP storage")


def local_bytes(sharding_plan):
    """Bytes of one device's shards of every variable of the plan."""
    sizes = dict(zip(sharding_plan.mesh.axis_names, sharding_plan.mesh.shape))
    return sum(
        v.total_bytes // math.prod(sizes[a] for a in v.spec if a is not None)
        for v in sharding_plan.variables
    )


def test_the_shallower_plan_is_the_full_plans_for_its_variables_and_layers(
    full_plan,
):
    paths = [v.path for v in ka.build_abstract(llama(2)).variables]
    reduced = restricted_plan(full_plan, paths)
    assert [v.path for v in reduced.variables] == sorted(paths)
    for variable in reduced.variables:
        assert variable.spec == full_plan.variable(variable.path).spec
    assert reduced.rematerialize == ("transformer_layer_1",)
    assert reduced.gradient_accumulation_steps == 2
    assert reduced.batch_axis == full_plan.batch_axis
    assert reduced.estimate is None


def test_the_planner_estimates_that_same_plan_fsdp_storage_included(full_plan):
    builder = llama(2)
    paths = [v.path for v in ka.build_abstract(builder).variables]
    reduced = restricted_plan(full_plan, paths)
    # Raises unless the planner's plan has the same levers.
    estimate, _, differences = pinned_estimate(builder, reduced, tokens(), TARGET)
    assert differences == []
    assert estimate.parameter_bytes == local_bytes(reduced)
    unpinned = plan_with_cost(
        builder,
        MESH,
        tokens(),
        PlanRequest(
            hardware=TARGET,
            rematerialize=["transformer_layer_1"],
            gradient_accumulation_steps=2,
        ),
    ).plan
    assert estimate.parameter_bytes < unpinned.estimate.parameter_bytes


def test_the_pinned_estimate_of_a_planners_own_plan_is_its_estimate():
    # Catches the pinned estimate drifting from `plan`'s own pipeline.
    planned = ka.plan(
        llama(2),
        MESH,
        tokens(),
        hardware=TARGET,
        rematerialize=["transformer_layer_0"],
        gradient_accumulation_steps=2,
    )
    estimate, _, differences = pinned_estimate(llama(2), planned, tokens(), TARGET)
    assert differences == []
    mine, theirs = estimate.to_dict(), planned.estimate.to_dict()
    for name in ("peak_bytes", "activation_bytes", "transient_bytes", "step_time_s"):
        assert mine[name] == theirs[name], name


def test_a_line_through_three_depths_extrapolates_to_the_full_depth():
    fit = fit_linear([2, 4, 8], [7.0, 11.0, 19.0])
    assert fit.per_layer == pytest.approx(2.0)
    assert fit.intercept == pytest.approx(3.0)
    assert fit.max_relative_residual == pytest.approx(0.0, abs=1e-12)
    assert fit.at(80) == pytest.approx(163.0)
    bent = fit_linear([2, 4, 8], [10.0, 20.0, 50.0])
    assert bent.max_relative_residual > 0.05
    with pytest.raises(ValueError, match="two points"):
        fit_linear([2], [1.0])


def test_the_estimated_step_covers_the_whole_batch_under_accumulation():
    costs = [
        plan_with_cost(
            llama(2),
            MESH,
            tokens(),
            PlanRequest(hardware=TARGET, gradient_accumulation_steps=k),
        ).plan.estimate
        for k in (1, 2)
    ]
    # The same FLOPs for the step whether fed whole or in 2 micro-batches:
    # tokens per step are the global batch's either way.
    assert costs[0].compute_flops == costs[1].compute_flops
    assert costs[1].step_time_s >= costs[0].step_time_s
    assert tokens_per_s_per_gpu(256, 4096, 4.0, 256) == pytest.approx(1024.0)
