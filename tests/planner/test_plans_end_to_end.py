"""The automatic planner: Megatron-shaped plans found from the graph alone,
parity with the single-device model, rules, budgets and errors."""

import numpy as np
import pytest

import keras_autoshard as ka
from keras_autoshard import MeshSpec
from keras_autoshard.errors import PlanError
from keras_autoshard.planner.plan_request import PlanRequest
from keras_autoshard.planner.planner import plan_with_cost
from keras_autoshard.testing import zoo
from tests.parity import check_parity

MESH_2x4 = MeshSpec((2, 4), ("batch", "model"))
MESH_1x8 = MeshSpec((1, 8), ("batch", "model"))
MESH_8x1 = MeshSpec((8, 1), ("batch", "model"))
TRANSFORMERS = ["gpt2", "bert", "opt", "gemma", "llama", "subclassed"]


def _plan(name, mesh, **kwargs):
    build, batch = zoo.ZOO[name]
    return ka.plan(build, mesh, sample_input=batch(), **kwargs)


def _dims_with_role(plan, role):
    return [
        (v, dim) for v in plan.variables for dim, r in enumerate(v.roles) if r == role
    ]


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_transformer_plan_is_megatron_shaped_on_the_model_axis(name):
    plan = _plan(name, MESH_2x4)
    assert plan.batch_axis == "batch"
    heads = _dims_with_role(plan, "heads")
    mlp = _dims_with_role(plan, "mlp")
    assert heads and mlp, "the planner must recognise heads and MLP dims"
    # Query heads and MLP hidden units are split over the model axis (column
    # then row): every parameter dim with those roles is sharded on it.
    for variable, dim in heads + mlp:
        assert variable.spec[dim] == "model", (variable.path, variable.spec)
    # The residual stream is never cut on the model axis.
    for variable, dim in _dims_with_role(plan, "embed"):
        assert variable.spec[dim] != "model", (variable.path, variable.spec)


def test_gqa_keeps_kv_heads_whole_and_says_so():
    plan = _plan("llama", MESH_2x4)
    kv = _dims_with_role(plan, "kv_heads")
    assert kv and all(v.spec[d] is None for v, d in kv)
    # Said once for every call it applies to (the keys and the values of
    # both layers), not once per call.
    [note] = [n for n in plan.notes if "GQA/MQA: 2 key/value heads" in n]
    assert note.endswith("(4 calls: in 'transformer_layer_0', 'transformer_layer_1').")


def test_products_a_plan_repeats_are_named_with_their_layers_and_price():
    # Llama's 2 key/value heads cannot be cut over the 4 devices of 'model',
    # so its key and value projections run whole on each of them: the note
    # gives the repeated FLOPs (the search's own figure), the layers and the
    # price that let them be. GPT-2 cuts every product: no such note.
    from keras_autoshard.planner.planner import plan_with_cost

    build, batch = zoo.ZOO["llama"]
    result = plan_with_cost(build, MESH_2x4, sample_input=batch())
    [note] = [n for n in result.plan.notes if n.startswith("Matrix products repeated")]
    assert f"{result.cost.replicated_flops:.3g} forward FLOPs" in note
    assert result.cost.replicated_flops > 0
    assert "'transformer_layer_0'" in note and "0.25 byte moved" in note
    gpt2 = _plan("gpt2", MESH_2x4)
    assert not [n for n in gpt2.notes if n.startswith("Matrix products repeated")]


def test_vocabulary_that_does_not_divide_is_replicated_with_a_note():
    plan = _plan("opt", MESH_2x4)
    embedding = plan.variable("embeddings/token_embedding/embeddings")
    assert embedding.spec[0] is None
    assert any("Vocabulary of 1003 does not divide" in n for n in plan.notes)


def test_tied_embedding_has_one_plan_for_lookup_and_projection():
    plan = _plan("tied", MESH_2x4)
    [embedding] = [v for v in plan.variables if v.path.endswith("embeddings")]
    assert embedding.roles == ("vocab", "embed")
    assert embedding.spec == ("model", None)


@pytest.mark.parametrize("mesh", [MESH_2x4, MESH_1x8, MESH_8x1], ids=str)
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_a_valid_plan_is_found_for_every_model_and_mesh(name, mesh):
    plan = _plan(name, mesh)
    build, _ = zoo.ZOO[name]
    from keras_autoshard.trace.tracer import build_abstract

    plan.validate(build_abstract(build))
    if mesh.shape[0] > 1:
        assert plan.batch_axis == "batch"


def test_planning_allocates_no_weights():
    from keras_autoshard.trace.tracer import build_abstract

    model = build_abstract(zoo.llama)
    ka.plan(model, MESH_2x4, sample_input=zoo.token_inputs(1024))
    assert all(v._value is None for v in model.variables)


def test_explain_gives_role_and_reason_per_variable():
    plan = _plan("gpt2", MESH_2x4)
    text = plan.explain()
    assert "transformer_layer_0/self_attention/query/kernel" in text
    assert "heads (dim 1) on 'model'" in text
    assert "Estimated peak per device" in text
    assert "Estimated communication per step" in text


def test_rules_pin_part_of_the_plan_and_the_planner_fills_the_rest():
    rules = {r".*feedforward_intermediate_dense/kernel": (None, None)}
    plan = _plan("gpt2", MESH_2x4, rules=rules)
    pinned = plan.variable("transformer_layer_0/feedforward_intermediate_dense/kernel")
    assert pinned.spec == (None, None) and pinned.reason == "user rule"
    query = plan.variable("transformer_layer_0/self_attention/query/kernel")
    assert query.spec == (None, "model", None)


def test_rule_that_matches_nothing_is_an_error():
    with pytest.raises(PlanError, match="match no variable"):
        _plan("gpt2", MESH_2x4, rules={r".*does_not_exist.*": (None,)})


def test_rules_that_cannot_hold_are_an_error_naming_the_rules_not_a_budget():
    with pytest.raises(PlanError, match="satisfies the rules") as error:
        _plan("mlp", MESH_2x4, rules={r".*mlp_up/kernel": ("batch", "model")})
    assert "mlp_up/kernel" in str(error.value) and "budget of" not in str(error.value)


def test_memory_budget_is_respected_and_impossible_budget_is_an_error():
    # The budget holds the whole peak of a training step (parameters,
    # gradients, optimizer slots, kept activations, data, transients).
    build, batch = zoo.ZOO["gpt2"]
    free = plan_with_cost(build, MESH_8x1, sample_input=batch())
    budget = int(0.8 * free.plan.estimate.peak_bytes)
    tight = plan_with_cost(build, MESH_8x1, batch(), PlanRequest(memory_budget=budget))
    assert tight.plan.estimate.peak_bytes <= budget
    assert tight.plan.estimate.budget_bytes == budget
    assert tight.plan.bytes_per_device() < free.plan.bytes_per_device()
    with pytest.raises(PlanError, match="No plan fits.*over by"):
        ka.plan(build, MESH_8x1, sample_input=batch(), memory_budget=1024)


def test_mesh_shape_is_chosen_by_cost_when_not_given():
    plan = _plan("gpt2", None, device_count=8)
    assert plan.mesh.device_count == 8 and plan.mesh.axis_names == ("batch", "model")


# Zoo model -> why its 5 Adam steps are judged against their measured
# sensitivity (`tests.parity.adam_steps_sensitivity`: twice how far the
# one-device steps move when every weight is nudged by ±1e-7) rather than
# 1e-5. Forward outputs and gradients keep 1e-5.
ILL_CONDITIONED_STEPS = {
    "opt": (
        "ReLU feed-forward after dropout 0.1: at the parity seed, three 1e-7 "
        "nudges move the one-device weights after 5 steps by 2.1e-4, 6.3e-4 "
        "and 2.1e-4 (transformer_layer_1's intermediate kernel: a unit whose "
        "gradient element changes sign, which Adam turns into a full "
        "learning-rate step); the 8x1 program compiled with LLVM -O0 lands "
        "on the 6.3e-4 side, and at the default level seed 1 fails 1e-5 "
        "(3.6e-5) while seed 1234 passes"
    ),
}


@pytest.mark.parametrize("mesh", [MESH_2x4, MESH_1x8, MESH_8x1], ids=str)
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_auto_plan_matches_single_device_after_5_adam_steps(name, mesh):
    build, batch = zoo.ZOO[name]
    x = batch()
    y = zoo.random_targets(build, x)
    dist = ka.AutoShardDistribution(device_mesh=mesh)
    _, sharded = check_parity(
        build, dist, x, y, ill_conditioned=ILL_CONDITIONED_STEPS.get(name, "")
    )
    assert dist.is_planned
    for v in sharded.trainable_variables:
        expected = dist.plan.variable(v.path).bytes_per_device(mesh)
        assert {s.data.nbytes for s in v.value.addressable_shards} == {expected}


def _output_shape(build, x):
    from keras_autoshard.trace.tracer import build_abstract, trace_model

    traced = trace_model(build_abstract(build), x)
    return tuple(traced.closed_jaxpr.out_avals[0].shape)


def test_fit_evaluate_predict_under_auto_shard_distribution():
    build, batch = zoo.ZOO["gpt2"]
    x = batch()
    y = np.random.default_rng(1).standard_normal((8, zoo.SEQ, 256)).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    with dist.scope():
        model = build()
        model.compile(optimizer="adam", loss="mse")
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        loss = model.evaluate(x, y, batch_size=8, verbose=0)
        out = model.predict(x, batch_size=8, verbose=0)
    assert dist.is_planned and dist.plan.batch_axis == "batch"
    assert np.isfinite(history.history["loss"]).all() and np.isfinite(loss)
    assert out.shape == (8, zoo.SEQ, 256)
    query = model.get_layer("transformer_layer_0")._self_attention_layer._query_dense
    assert query.kernel.value.sharding.spec[1] == "model"
    slot_specs = {
        tuple(v.value.sharding.spec)
        for v in model.optimizer.variables
        if "query_kernel" in v.path
    }
    assert slot_specs == {(None, "model", None)}


@pytest.mark.parametrize("entry", ["predict", "predict_on_batch"])
def test_predict_first_plans_on_its_first_batch_and_matches_one_device(entry):
    import keras

    build, batch = zoo.ZOO["mlp"]
    x = batch()
    keras.utils.set_random_seed(7)
    reference = build()
    expected = np.asarray(reference.predict_on_batch(x))
    dist = ka.AutoShardDistribution(device_mesh=MESH_1x8)
    with dist.scope():
        keras.utils.set_random_seed(7)
        model = build()
        assert not dist.is_planned
        if entry == "predict":
            out = model.predict(x, batch_size=8, verbose=0)
        else:
            out = model.predict_on_batch(x)
    assert dist.is_planned
    up = model.get_layer("mlp_up").kernel.value.sharding.spec
    assert "model" in tuple(up), up
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)
