"""Compiled collective bytes of automatic plans against hand-written Megatron
plans and KerasHub's own layout maps, and the tight memory budget."""

import dataclasses

import pytest

import keras_autoshard as ka
from keras_autoshard import MeshSpec, PlanDistribution, plan_from_rules
from keras_autoshard.building import names_replayed_after
from keras_autoshard.planner.planner import plan_with_cost
from keras_autoshard.plans.estimate import HEADROOM
from keras_autoshard.plans.layouts import ActivationLayout
from keras_autoshard.report.compiled_program import MEMORY_SCHEDULE_ON_CPU
from keras_autoshard.report.estimate_check import compiled_peak_bytes
from keras_autoshard.testing import zoo
from keras_autoshard.testing.compiled import compiled_as_planned, compiled_report
from keras_autoshard.testing.reference_plans import (
    keras_hub_layout_map,
    keras_hub_megatron_plan,
)

MESHES = [
    MeshSpec((2, 4), ("batch", "model")),
    MeshSpec((1, 8), ("batch", "model")),
    MeshSpec((8, 1), ("batch", "model")),
]
KERAS_HUB = ["gpt2", "bert", "opt", "gemma", "llama"]
# Hand-written Megatron rules for the models that are not KerasHub backbones.
HANDWRITTEN_RULES = {
    "mlp": {
        "mlp_up/kernel": (None, "model"),
        "mlp_up/bias": ("model",),
        "mlp_down/kernel": ("model", None),
    },
    "tied": {r".*embedding/embeddings": ("model", None)},
    "cnn": {},
}


def _subclassed_rules(paths):
    """q/k/v and MLP-up column-parallel, out and MLP-down row-parallel.

    Each block's Dense layers are created in the order q, k, v, out, up, down.
    """
    kernels = [
        p for p in paths if "self_attention_block" in p and p.endswith("/kernel")
    ]
    dense = [p for p in kernels if "/dense" in p]
    dense.sort(
        key=lambda p: int(p.rsplit("/", 2)[-2].removeprefix("dense").lstrip("_") or 0)
    )
    rules = {}
    for index, path in enumerate(dense):
        role = ("q", "k", "v", "out", "up", "down")[index % 6]
        rules[re_escape(path)] = (
            ("model", None) if role in ("out", "down") else (None, "model")
        )
    return rules


def _layer_number(path):
    layer = path.rsplit("/", 2)[-2]
    return int(layer.removeprefix("dense").lstrip("_") or 0)


def re_escape(path):
    import re

    return re.escape(path)


def _handwritten(name, model, mesh):
    if name in KERAS_HUB:
        return keras_hub_megatron_plan(model, mesh)
    if name == "subclassed":
        rules = _subclassed_rules([v.path for v in model.variables])
    else:
        rules = HANDWRITTEN_RULES[name]
    plan = plan_from_rules(
        model.variables, mesh, rules, batch_axis="batch", check_structure=False
    )
    return plan


def _batch(name):
    build, batch = zoo.ZOO[name]
    x = batch()
    return build, x, zoo.random_targets(build, x)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_auto_plan_moves_no_more_bytes_than_the_handwritten_megatron_plan(name, mesh):
    build, x, y = _batch(name)
    auto = ka.plan(build, mesh, sample_input=x)
    with names_replayed_after():
        reference = build()
    handwritten = _handwritten(name, reference, mesh)
    auto_report = compiled_report(build, PlanDistribution(auto), x, y)
    hand_report = compiled_report(build, PlanDistribution(handwritten), x, y)
    auto_step, hand_step = auto_report.train_step, hand_report.train_step
    if auto_step.operand_bytes() <= hand_step.operand_bytes():
        return
    # Where no data axis can cut the batch (1x8), the planner first leaves
    # the least compute repeated on the devices, then moves the fewest bytes
    # (issue 33: eight devices must not each run the whole step to save
    # bytes): it may move more than Megatron's rules only with fewer FLOPs
    # per device (XLA's cost analysis of the compiled steps). Measured on
    # 1x8: the CNN (the rules keep it whole on every device; the plan cuts
    # its channels), the MLP (the rules repeat its head; the plan cuts it
    # too) and the tied model (the batch over 'model').
    assert mesh.axis_size("batch") == 1, (name, mesh)
    assert auto_step.flops < hand_step.flops, (auto_step.flops, hand_step.flops)


# KerasHub's Llama map cannot run on 8x1 (it cuts 2 KV heads 8 ways).
KERAS_HUB_CASES = [("gemma", mesh) for mesh in MESHES] + [
    ("llama", mesh) for mesh in MESHES[:2]
]


@pytest.mark.parametrize("name, mesh", KERAS_HUB_CASES, ids=str)
def test_auto_plan_moves_fewer_bytes_than_keras_hub_layout_map(name, mesh):
    build, x, y = _batch(name)
    auto = ka.plan(build, mesh, sample_input=x)
    auto_bytes = compiled_report(build, PlanDistribution(auto), x, y)
    hub_bytes = compiled_report(build, keras_hub_layout_map(build, mesh), x, y)
    assert auto_bytes.train_step.operand_bytes() < hub_bytes.train_step.operand_bytes()


def test_data_only_mesh_trades_the_embedding_gradient_all_reduce_as_estimated():
    """On 8x1 the table is FSDP-cut on its hidden dim: no all-reduce of its
    gradient, and the estimate matches the compiled bytes."""
    mesh = MESHES[2]
    build, x, y = _batch("gemma")
    result = plan_with_cost(build, mesh, sample_input=x)
    assert result.plan.variable("token_embedding/embeddings").spec == (None, "batch")
    report = compiled_report(build, PlanDistribution(result.plan), x, y)
    reduced = [op for op in report.train_step.collectives if op.kind == "all-reduce"]
    assert not any("f32[1024,256]" in op.operand_shapes for op in reduced)
    compiled = report.train_step.operand_bytes()
    assert abs(result.cost.communication_bytes - compiled) <= 0.01 * compiled
    # Less than plain data parallelism, which all-reduces every gradient.
    assert compiled < result.plan.total_bytes()


def _tight_plan(name, mesh, rematerialize="auto", batch_over_model_axes=True):
    """The plan for a budget that leaves the state (parameters, gradients,
    Adam's two moments) 1.05 × its size cut over every device and the
    gathered copies of weights stored cut, the rest of
    the free plan's peak as it is; with the model's builder, batch and that
    budget. The budget holds the whole peak and plans fill 90 % of it
    (`plans.estimate.HEADROOM`)."""
    build, x, y = _batch(name)
    free = ka.plan(
        build, mesh, sample_input=x, batch_over_model_axes=batch_over_model_axes
    )
    estimate = free.estimate
    state = estimate.parameter_bytes + estimate.gradient_bytes
    state += estimate.optimizer_bytes
    devices = mesh.device_count
    model_ways = mesh.shape[mesh.axis_names.index("model")]
    # Cut over every device, plus the all-gathered weights the backward pass
    # keeps when they are stored cut over the data axis (FSDP): each weight's
    # tensor-parallel part less this device's stored part.
    floor = 1.05 * free.total_bytes() * (4 / devices + 1 / model_ways - 1 / devices)
    budget = int((estimate.peak_bytes - state + floor) / (1 - HEADROOM["XLA:CPU"]))
    tight = ka.plan(
        build,
        mesh,
        sample_input=x,
        memory_budget=budget,
        rematerialize=rematerialize,
        batch_over_model_axes=batch_over_model_axes,
    )
    return build, x, y, tight, budget


@pytest.mark.parametrize("name, mesh", KERAS_HUB_CASES, ids=str)
def test_tight_budget_plan_fits_and_moves_no_more_than_keras_hub_layout_map(name, mesh):
    """With 1.05 × (parameters + Adam) ÷ devices the plan's compiled step
    fits the budget (its compiled peak, not only its state) and moves no
    more bytes than KerasHub's map. Plans are symmetric
    (every transformer layer cut alike), so a budget that needs FSDP on
    nearly every layer gets it on every layer: Gemma on 2x4 then moves
    exactly what KerasHub's map moves (an uneven mix of layers, before
    symmetric plans, moved less). On the data-only 8x1
    mesh the budget leaves one plan, full FSDP, which is what KerasHub's map
    is there: equal bytes, not more."""
    build, x, y, tight, budget = _tight_plan(name, mesh)
    # The budget holds the whole peak: the compiled step as the plan says
    # (its rematerialized layers, its micro-batches), scheduled for memory as
    # accelerators schedule it, must fit it, not only its state.
    as_planned = compiled_as_planned(
        tight, build, x, y, compiler_options=MEMORY_SCHEDULE_ON_CPU
    )
    compiled = compiled_peak_bytes(as_planned.train_step.memory)
    assert compiled <= budget, (name, mesh, compiled, budget)
    # Bytes are compared on the same step for both layouts (no levers: a
    # rematerialized layer's recomputation repeats its forward collectives,
    # which KerasHub's map, never rematerialized, does not pay).
    report = compiled_report(build, PlanDistribution(tight), x, y)
    hub = compiled_report(build, keras_hub_layout_map(build, mesh), x, y)
    auto_bytes = report.train_step.operand_bytes()
    hub_bytes = hub.train_step.operand_bytes()
    assert auto_bytes <= hub_bytes


def test_storage_cut_table_gathers_its_lookup_output_once():
    """Gemma on 1x8 under the tight budget: the table is cut for storage only
    and the plan pins the lookup's output. The planner cuts the table along
    its hidden dim (the storage cut the pin matters most for; it cut the
    vocabulary, of equal bytes, before issue 33's estimate changes: each
    use's partial gradient of the tied table reduced apart, a stored-cut
    weight gathered beside its whole gradient), and the compiled step
    gathers the output once (without the pin XLA carried the hidden cut
    into the residual stream: 8 all-gathers of the activation and an
    all-reduce per norm)."""
    mesh = MESHES[1]
    build, x, y, tight, _ = _tight_plan("gemma", mesh)
    assert tight.variable("token_embedding/embeddings").spec == (None, "model")
    assert [(a.path, a.spec) for a in tight.activations] == [
        ("token_embedding/output", (None, None, None))
    ]
    report = compiled_report(build, PlanDistribution(tight), x, y)
    activation_bytes = zoo.BATCH * zoo.SEQ * 256 * 4 // mesh.device_count
    gathers = [
        op
        for op in report.train_step.collectives
        if op.kind == "all-gather" and op.operand_bytes == activation_bytes
    ]
    assert len(gathers) == 1
    unpinned = dataclasses.replace(tight, activations=())
    before = compiled_report(build, PlanDistribution(unpinned), x, y)
    assert report.train_step.operand_bytes() < before.train_step.operand_bytes()


# The layer outputs the earlier pin rule pinned in OPT's tight 1x8 plan (every
# layer owning a parameter cut for storage only), and the two lookups alone.
OPT_EVERY_STORAGE_CUT_LAYER = (
    "embeddings/token_embedding",
    "embeddings/position_embedding",
    "layer_norm",
    *(
        f"transformer_layer_{i}/{layer}"
        for i in range(2)
        for layer in (
            "self_attention_layer_norm",
            "self_attention/attention_output",
            "feedforward_layer_norm",
            "feedforward_output_dense",
        )
    ),
)
OPT_LOOKUPS = ("embeddings/token_embedding", "embeddings/position_embedding")


def test_storage_cut_pins_are_taken_only_where_they_move_fewer_bytes():
    """OPT on 1x8 under the tight budget, storage cuts only (with
    rematerialization offered the planner recomputes a layer instead): its
    norm scales and biases are cut over `model` on the hidden dim, so XLA
    holds the residual stream cut so (`stream_drift.stream_drift`), and the
    token and position tables are cut over `model` too. The plan pins no
    layer output, and its step moves fewer bytes than with the pins of the
    earlier rule (every storage-cut layer: 7.34 MB against 6.90 MB), than
    with the lookups' pins only (7.02 MB) and than with the position
    lookup's only (6.95 MB), each measured on this step.

    The pins are a tensor-parallel plan's (`TensorParallel`'s on 1x8, which
    keeps 'model' for the model): with the batch free to take 'model', this
    budget is met by data parallelism over it with every weight stored cut
    (ZeRO-3, 5.70 MiB estimated per step), which pins nothing."""
    build, x, y, tight, _ = _tight_plan(
        "opt", MESHES[1], rematerialize="none", batch_over_model_axes=False
    )
    for table in OPT_LOOKUPS:
        assert tight.variable(f"{table}/embeddings").spec != (None, None)
    assert tight.activations == ()
    planned = compiled_report(build, PlanDistribution(tight), x, y)
    planned_bytes = planned.train_step.operand_bytes()
    for layers in (
        OPT_EVERY_STORAGE_CUT_LAYER,
        OPT_LOOKUPS,
        ("embeddings/position_embedding",),
    ):
        pins = tuple(ActivationLayout(f"{path}/output", (None,) * 3) for path in layers)
        other = dataclasses.replace(tight, activations=pins)
        before = compiled_report(build, PlanDistribution(other), x, y)
        assert planned_bytes < before.train_step.operand_bytes(), layers
