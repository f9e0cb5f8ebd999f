"""Every Backbone class that keras_hub 0.32.0 exports, on 2x4 (and 1x8, 8x1):
the text classes here, the others in `tests/test_model_coverage_images.py`.

Each class is built once from a small config
(`keras_autoshard/testing/hub_backbones`, batch 8) on one device; on a mesh
`AutoShardDistribution.prepare` plans it and moves its variables, and the
forward pass under the plan must match one device within 1e-5 relative, with
the batch split over the data axis (8 divides every data axis here). Text
backbones also take one training step on 2x4 (loss, every gradient, every
updated weight): there one plan and one program per side give the forward
outputs and the step (`check_on_mesh(..., train=True)`). The checks are
`keras_autoshard.testing.model_coverage`'s; `benchmarks/model_coverage.py`
runs them to write the BENCHMARKS.md table (every class on all three
meshes).

Meshes: the default run checks every class on 2x4, which has both a data
axis and a model axis, so it exercises the batch-split rule and the
tensor-parallel rules at once; 1x8 exercises the same tensor-parallel rules
alone (over 8 devices instead of 4) and 8x1 the same batch rule alone (over
8 instead of 2). A class also runs on 8x1 where that mesh takes another rule
than 2x4 (`OTHER_RULE_MESHES`: the grouped convolutions, whose batch is cut
over both axes on 2x4, over 'batch' on 8x1). `KERAS_AUTOSHARD_ALL_MESHES=1`
runs every class on all three meshes, as the benchmark does.

Exceptions are listed below with their reason; a listed class must still fail
(or keep its batch whole) for the reason given, so the list cannot go stale.
"""

import functools
import os

import jax
import keras_hub
import pytest

import keras_autoshard as ka
from keras_autoshard.testing import model_coverage as coverage
from keras_autoshard.testing.hub_backbones import (
    CASES,
    build,
    exported_backbone_classes,
)

KERAS_HUB_VERSION = "0.32.0"
EXPORTED_BACKBONE_COUNT = 84
TOLERANCE = 1e-5
TRAIN_MESH = "2x4"

# Class → (why its batch is kept whole on a data axis, the phrase of the
# plan's note that must say so, naming the op and the layer, the meshes).
EVERY_MESH = ("2x4", "8x1", "1x8")
GROUPED_CONV = (
    "XLA's partitioner (jax 0.10.2) over-reduces a grouped convolution's "
    "filter gradient when the batch is cut over part of the mesh only "
    "(tests/planner/test_grouped_conv.py), so on 2x4 the planner needs the conv's "
    "channels on 'model' as well, and here they cannot all take it: the "
    "batch goes over both axes"
)
BATCH_KEPT_WHOLE: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "DFineBackbone": (
        "its query selection maps over the batch with `keras.ops.map`, a scan "
        "whose iterations are the batch rows; XLA runs a loop's iterations in "
        "order on every device and cannot split them",
        "scanned dim of scan in layer 'initial_query_reference_generator'",
        EVERY_MESH,
    ),
    "Gemma3nBackbone": (
        "it appends a dummy image to the flattened images (b·n + 1 rows, "
        "which no data axis divides) and gathers the vision embeddings into "
        "the text by a cumsum over all tokens of the batch",
        "concatenated dim of concatenate in layer 'multimodal_embedding_processor'",
        EVERY_MESH,
    ),
    "SAM3PromptableConceptBackbone": (
        "its geometry encoder flattens the batch with the prompt sequence and "
        "scatters into it at computed positions (`ops.scatter_update`): the "
        "rows a device would own are only known at run time",
        "scattered dim of scatter in layer 'sam3_geometry_encoder'",
        EVERY_MESH,
    ),
}

# Class → (why its input's batch is kept whole on 1x8, where 'model' may cut
# it, the phrase of the plan's note that says so). Every other class cuts it
# over 'model' there (issue 33: eight devices must not each run the step).
WHOLE_INPUT_ON_1X8: dict[str, tuple[str, str]] = {
    "FNetBackbone": (
        "every matrix product divides over 'model' and moves fewer bytes "
        "than the gradients' all-reduce would",
        "repeats no more matrix products on the devices",
    ),
    "VideoPrismBackbone": (
        "it merges the batch with the frames; 'model' cuts the merged rows",
        "'model' cuts the 128 rows it is reshaped into instead",
    ),
}

# Class → why its batch is cut over every axis of 2x4 (`("batch", "model")`,
# `MeshAxis.spanning`) instead of over 'batch' alone; kept whole before.
BATCH_OVER_EVERY_AXIS: dict[str, str] = {
    "HGNetV2Backbone": GROUPED_CONV + " (its channels are concatenated)",
    "Qwen3_5Backbone": GROUPED_CONV + " (its channels are sliced into q, k, v)",
    "Qwen3_5MoeBackbone": GROUPED_CONV + " (its channels are sliced into q, k, v)",
    "XceptionBackbone": GROUPED_CONV
    + " (each separable conv's pointwise kernel would need both its channel "
    "dims on 'model')",
}

# Class → why its training step is checked against a looser bound. The
# bound is earned in the test: `train_step_sensitivity` nudges every weight
# by ±1e-7 (relative) on one device and measures how far the gradients move;
# the class must move by at least half the tolerance, and its sharded step
# may then differ by up to twice that measured change (the same order: a
# sharded step differs from one device by the order of its sums only).
ILL_CONDITIONED_TRAINING: dict[str, str] = {
    "EdRecBackbone": "gradients move by ~4e-5 under the nudge (cross-attention)",
    "SigLIPTextEncoder": (
        "~1e-5: the worst is an attention key bias, whose gradient is zero "
        "analytically (softmax is invariant to it), so pure rounding"
    ),
    "T5Backbone": "~1.6e-5 under the nudge (relative attention buckets)",
    "T5Gemma2Backbone": "~8e-6 under the nudge (query/key norms)",
}

# Class → (why it cannot be planned, a phrase of the clear error it raises).
NOT_TRACEABLE: dict[str, tuple[str, str]] = {
    "StableDiffusion3Backbone": (
        "its scheduler builds `ops.linspace(..., num_steps)` from the "
        "`num_steps` input, which jax.jit cannot trace (a traced length)",
        "tracing stopped in layer 'scheduler' (FlowMatchEulerDiscreteScheduler)",
    ),
}


@functools.lru_cache(maxsize=1)
def built_backbone(class_name: str) -> coverage.BuiltBackbone:
    """The class built on one device; kept while its meshes run (the cases are
    ordered class by class). Its reference outputs are computed by the first
    check (a text class's training step computes them in its own program)."""
    return coverage.build_backbone(CASES[class_name], reference=False)


def test_cases_cover_every_exported_backbone_class():
    assert keras_hub.__version__ == KERAS_HUB_VERSION
    exported = exported_backbone_classes()
    assert len(exported) == EXPORTED_BACKBONE_COUNT
    assert sorted(CASES) == exported
    modalities = {case.modality for case in CASES.values()}
    assert modalities == {"text", "vision", "audio", "multimodal"}


# Class → the meshes besides 2x4 where it takes another rule than on 2x4.
OTHER_RULE_MESHES: dict[str, tuple[str, ...]] = {
    class_name: ("8x1",) for class_name in BATCH_OVER_EVERY_AXIS
}
ALL_MESHES = os.environ.get("KERAS_AUTOSHARD_ALL_MESHES") == "1"


def _meshes(class_name: str) -> list[str]:
    if ALL_MESHES:
        return list(coverage.MESHES)
    return ["2x4", *OTHER_RULE_MESHES.get(class_name, ())]


TRAIN_STEP = TRAIN_MESH + " and a train step"


def checks(text: bool) -> list[tuple[str, str]]:
    """(class, check) of the text classes (`text=True`: the meshes, 2x4 with
    the training step) or of the others (vision, audio, multimodal: the
    meshes), class by class. The two halves are two test files
    (`tests/test_model_coverage_images.py` has the other), so that the
    suite's two workers share the sweep (a test file runs on one worker)."""
    return [
        (class_name, check)
        for class_name, case in sorted(CASES.items())
        if (case.modality == "text") == text
        for mesh in _meshes(class_name)
        for check in [
            TRAIN_STEP
            if text and mesh == TRAIN_MESH and class_name not in NOT_TRACEABLE
            else mesh
        ]
    ]


@pytest.mark.slow
@pytest.mark.parametrize("class_name, check", checks(text=True))
def test_backbone_plans_and_matches_one_device(class_name, check):
    """`check` is a mesh (forward parity, batch split) or the training step;
    they run class by class so that each class is built once."""
    run_check(class_name, check)


def run_check(class_name: str, check: str) -> None:
    """Runs one (class, check) of `checks`."""
    if class_name in NOT_TRACEABLE:
        assert_fails_with_a_clear_error(class_name, check)
        return
    built = built_backbone(class_name)
    train = check == TRAIN_STEP
    mesh_name = TRAIN_MESH if train else check
    row = coverage.check_on_mesh(built, mesh_name, train=train)
    assert_forward_matches_on_mesh(row)
    if train:
        assert_trains_one_step_like_one_device(built, row.train)


def assert_forward_matches_on_mesh(row: coverage.CoverageRow) -> None:
    class_name, mesh_name = row.class_name, row.mesh
    assert row.status == "ok", f"{class_name} on {mesh_name}: {row.status}"
    assert row.parity <= TOLERANCE, (
        f"{class_name} on {mesh_name}: relative error {row.parity:.3g}"
    )
    data_axis_size = coverage.MESHES[mesh_name].shape[0]
    if data_axis_size == 1 and class_name in WHOLE_INPUT_ON_1X8:
        assert row.batch_axis is None
        assert WHOLE_INPUT_ON_1X8[class_name][1] in row.batch_note, row.batch_note
        return
    assert coverage.BATCH_SIZE % data_axis_size == 0
    if class_name in BATCH_KEPT_WHOLE and mesh_name in BATCH_KEPT_WHOLE[class_name][2]:
        assert row.batch_axis is None
        assert BATCH_KEPT_WHOLE[class_name][1] in row.batch_note, row.batch_note
    elif class_name in BATCH_OVER_EVERY_AXIS and mesh_name == "2x4":
        assert row.batch_axis == ("batch", "model"), row.batch_note
    else:
        expected = "model" if data_axis_size == 1 else "batch"
        assert row.batch_axis == expected, (
            f"{class_name} on {mesh_name} keeps its batch whole: {row.batch_note}"
        )


def assert_fails_with_a_clear_error(class_name, mesh_name):
    """The class cannot be traced: planning names where and why, and the
    cause is JAX's own (a concrete value asked of a traced one)."""
    case = CASES[class_name]
    model = build(case)
    inputs = case.make_inputs(coverage.BATCH_SIZE)
    with pytest.raises(ka.errors.ModelNotTraceableError) as error:
        ka.plan(model, coverage.MESHES[mesh_name], sample_input=inputs)
    assert NOT_TRACEABLE[class_name][1] in str(error.value)
    assert isinstance(error.value.__cause__, jax.errors.ConcretizationTypeError)


def assert_trains_one_step_like_one_device(built, parity):
    bound = TOLERANCE
    if built.case.class_name in ILL_CONDITIONED_TRAINING:
        sensitivity = coverage.train_step_sensitivity(built)
        assert sensitivity >= TOLERANCE / 2, (
            f"{built.case.class_name} moves by {sensitivity:.3g} only: not "
            "ill-conditioned, take it off the list"
        )
        bound = max(TOLERANCE, 2 * sensitivity)
    assert parity.loss <= TOLERANCE, parity
    assert parity.gradients <= bound, parity
    assert parity.weights <= bound, parity
