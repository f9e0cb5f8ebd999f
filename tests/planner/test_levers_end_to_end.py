"""Levers besides rematerialization: gradient accumulation when nothing else
fits, the inference job's budget, and the note that explains variables kept
whole."""

import numpy as np
import pytest

from keras_autoshard import MeshSpec, ShardingPlan, plan
from keras_autoshard.errors import PlanError
from keras_autoshard.testing import zoo

MESH = MeshSpec((2, 4), ("batch", "model"))


def test_gradient_accumulation_is_chosen_only_when_nothing_else_fits():
    # A batch of 64 sequences: the zoo's 8 leave activations too small a
    # part of the peak for accumulation to help (its update holds the
    # variables and their slots twice).
    build, _ = zoo.ZOO["llama"]
    x = zoo.token_inputs(1024, batch=64)
    free = plan(build, MESH, x)
    estimate = free.estimate
    state = estimate.parameter_bytes + estimate.gradient_bytes
    state += estimate.optimizer_bytes
    # 45 % of the free plan's peak: no sharding with rematerialization of
    # the whole batch fits (measured: 45 % and 50 % need 2 micro-batches,
    # 35 % nothing fits).
    budget = int(0.45 * estimate.peak_bytes)
    with pytest.raises(PlanError, match="No plan fits"):
        plan(build, MESH, x, memory_budget=int(0.2 * state))
    # Nothing else fits: every plan of the whole batch (any sharding, any
    # rematerialization) is over the budget.
    with pytest.raises(PlanError, match="No plan fits"):
        plan(build, MESH, x, memory_budget=budget, gradient_accumulation_steps=1)
    accumulated = plan(build, MESH, x, memory_budget=budget)
    steps = accumulated.gradient_accumulation_steps
    assert steps > 1
    assert accumulated.estimate.fits
    assert any(
        "gradient accumulation over" in lever for lever in accumulated.estimate.levers
    )
    # The accumulator: one more copy of every trainable variable's shard
    # (all of this model's variables are trainable).
    assert (
        accumulated.estimate.optimizer_bytes == 3 * accumulated.estimate.parameter_bytes
    )
    roundtrip = ShardingPlan.from_json(accumulated.to_json())
    assert roundtrip.gradient_accumulation_steps == steps
    # A budget the whole batch fits gets no accumulation.
    assert (
        plan(
            build, MESH, x, memory_budget=2 * estimate.peak_bytes
        ).gradient_accumulation_steps
        == 1
    )


def test_inference_plans_budget_no_gradients_nor_optimizer_state():
    build, batch = zoo.ZOO["llama"]
    x = batch()
    inference = plan(build, MESH, x, job="inference")
    train = plan(build, MESH, x)
    estimate = inference.estimate
    assert estimate.job == "inference"
    assert estimate.gradient_bytes == estimate.optimizer_bytes == 0
    assert estimate.activation_bytes == 0
    assert estimate.peak_bytes < train.estimate.peak_bytes
    with pytest.raises(ValueError, match="job="):
        plan(build, MESH, x, job="serve")


def test_variables_kept_whole_beyond_an_even_cut_are_named_in_a_note():
    import keras

    def wide_table():
        ids = keras.Input((16,), dtype="int32")
        h = keras.layers.Embedding(4096, 64, name="table")(ids)
        return keras.Model(ids, keras.layers.Dense(64, name="head")(h))

    x = np.zeros((8, 16), "int32")
    sharding_plan = plan(wide_table, MeshSpec((1, 8), ("batch", "model")), x)
    if any(sharding_plan.variable("table/embeddings").spec):
        pytest.fail("expected the table kept whole on 1x8 (cutting it adds traffic)")
    notes = [n for n in sharding_plan.notes if n.startswith("Variables per device")]
    assert len(notes) == 1 and "table/embeddings" in notes[0], sharding_plan.notes


def test_rematerialize_request_is_followed_and_unknown_layers_are_named():
    build, batch = zoo.ZOO["llama"]
    x = batch()
    every = plan(build, MESH, x, rematerialize="all")
    assert every.rematerialize == ("transformer_layer_0", "transformer_layer_1")
    one = plan(build, MESH, x, rematerialize=["transformer_layer_1"])
    assert one.rematerialize == ("transformer_layer_1",)
    assert every.estimate.recompute_flops > one.estimate.recompute_flops > 0
    assert plan(build, MESH, x, rematerialize="none").rematerialize == ()
    with pytest.raises(PlanError, match=r"transformer_layer_7.*layer calls"):
        plan(build, MESH, x, rematerialize=["transformer_layer_7"])
    with pytest.raises(PlanError, match="rematerialize='some'"):
        plan(build, MESH, x, rematerialize="some")
    # A model with no repeated layers: "all" is refused, naming its calls.
    mlp, mlp_batch = zoo.ZOO["mlp"]
    with pytest.raises(PlanError, match=r"rematerialize='all'.*has none"):
        plan(mlp, MESH, mlp_batch(), rematerialize="all")


def test_gradient_accumulation_asked_for_is_planned_for_that_micro_batch():
    build, _ = zoo.ZOO["llama"]
    x = zoo.token_inputs(1024, batch=16)
    whole = plan(build, MESH, x, gradient_accumulation_steps=1)
    asked = plan(build, MESH, x, gradient_accumulation_steps=4)
    assert whole.gradient_accumulation_steps == 1
    assert asked.gradient_accumulation_steps == 4
    assert asked.estimate.levers[-1].endswith("(asked for)")
    # One micro-batch's activations (and data), plus an accumulator per
    # trainable variable.
    assert asked.estimate.activation_bytes < 0.3 * whole.estimate.activation_bytes
    assert asked.estimate.optimizer_bytes == pytest.approx(
        1.5 * whole.estimate.optimizer_bytes, rel=1e-6
    )
    with pytest.raises(PlanError, match="multiple of it"):
        plan(build, MESH, x, gradient_accumulation_steps=3)
