"""Rematerialization and sequence parallelism reach the repeated layers of a
wrapped model: a KerasHub task around its backbone, a model that calls
another.

The repeated layers are found at the shallowest level of the layer paths
where copies of a layer sit side by side (`graph/blocks.py`), so the
task's units are `gpt2_backbone/transformer_layer_0` and `_1`, and
`rematerialize` checkpoints the layers at those paths. Before, the units
were the task's top-level layers (the backbone, once): a fine-tune of a
task could not be rematerialized (`rematerialize="all"` chose nothing).
"""

import keras
import pytest

from keras_autoshard import MeshSpec, PlanDistribution, plan, rematerialize
from keras_autoshard.building import build_abstract
from keras_autoshard.errors import PlanError
from keras_autoshard.graph.blocks import unit_namer
from keras_autoshard.report.compiled_program import MEMORY_SCHEDULE_ON_CPU
from keras_autoshard.report.estimate_check import compiled_peak_bytes
from keras_autoshard.testing import zoo
from keras_autoshard.testing.compiled import compiled_as_planned, plan_distribution
from tests.parity import check_parity, rematerialized_under

MESH = MeshSpec((2, 4), ("batch", "model"))


def test_units_are_the_layers_where_copies_sit_side_by_side():
    unit_of = unit_namer(
        [
            "lm/embed",
            "lm/block/attention/dense",
            "lm/block/attention/dense_1",
            "lm/block_1/attention/dense",
            "lm/norm",
            "head",
            "",
        ]
    )
    assert unit_of("lm/block_1/attention/dense") == "lm/block_1"
    assert unit_of("lm/block/attention") == "lm/block"
    assert unit_of("lm/norm") == "lm/norm"
    assert unit_of("head") == "head"  # under no level with copies
    assert unit_of("") == ""
    # Copies at the top: the top-level layers, as for a backbone itself.
    top = unit_namer(["block/dense", "block/dense_1", "block_1/dense_2", "out"])
    assert top("block_1/dense_2") == "block_1"
    assert top("out") == "out"


class Wrapper(keras.Model):
    """A model whose call is another model's (as TensorParallel wraps)."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x):
        return self.inner(x)


def _wrapped_subclassed():
    model = Wrapper(zoo.subclassed())
    model.build((None, zoo.SEQ, 128))
    return model


def test_a_wrapped_model_rematerializes_its_blocks_with_parity():
    _, batch = zoo.ZOO["subclassed"]
    x = batch()
    y = zoo.random_targets(_wrapped_subclassed, x)
    sharding_plan = plan(_wrapped_subclassed, MESH, x, rematerialize="all")
    assert len(sharding_plan.rematerialize) == 2, sharding_plan.rematerialize
    assert all("/self_attention_block" in name for name in sharding_plan.rematerialize)
    free = plan(_wrapped_subclassed, MESH, x)
    assert sharding_plan.estimate.peak_bytes < free.estimate.peak_bytes
    check_parity(
        rematerialized_under(sharding_plan, _wrapped_subclassed),
        PlanDistribution(sharding_plan),
        x,
        y,
        steps=3,
    )


@pytest.fixture(scope="module")
def gpt2_task():
    import keras_hub

    # A task's constructor compiles an optimizer, which an abstract build
    # cannot hold: the task around an abstract backbone.
    return keras_hub.models.GPT2CausalLM(
        backbone=build_abstract(zoo.gpt2), preprocessor=None
    )


def test_a_kerashub_task_rematerializes_its_backbone_layers(gpt2_task):
    x = zoo.token_inputs(1024)
    sharding_plan = plan(gpt2_task, MESH, x, rematerialize="all")
    backbone = gpt2_task.backbone.name  # gpt2_backbone, numbered after others
    assert sharding_plan.rematerialize == (
        f"{backbone}/transformer_layer_0",
        f"{backbone}/transformer_layer_1",
    )
    free = plan(gpt2_task, MESH, x)
    # The backbone's layers keep only their inputs (was: nothing to choose).
    assert sharding_plan.estimate.peak_bytes < 0.85 * free.estimate.peak_bytes


def _wrapped_gpt2():
    model = Wrapper(zoo.gpt2())
    model.built = True  # its one layer, the functional backbone, is built
    return model


def test_a_wrapped_backbone_compiles_its_rematerialized_layers():
    x = zoo.token_inputs(1024)
    y = zoo.random_targets(_wrapped_gpt2, x)
    sharding_plan = plan(_wrapped_gpt2, MESH, x, rematerialize="all")
    assert len(sharding_plan.rematerialize) == 2, sharding_plan.rematerialize
    free = plan(_wrapped_gpt2, MESH, x)
    planned = compiled_as_planned(
        sharding_plan, _wrapped_gpt2, x, y, compiler_options=MEMORY_SCHEDULE_ON_CPU
    ).train_step
    unplanned = compiled_as_planned(
        free, _wrapped_gpt2, x, y, compiler_options=MEMORY_SCHEDULE_ON_CPU
    ).train_step
    # The recomputed forward pass, and the memory it saves.
    assert planned.matmuls > unplanned.matmuls
    compiled = compiled_peak_bytes(planned.memory)
    assert compiled < compiled_peak_bytes(unplanned.memory)
    ratio = sharding_plan.estimate.peak_bytes / compiled
    assert abs(ratio - 1) <= 0.15, (ratio, sharding_plan.estimate.to_dict())


def test_a_name_two_layers_share_is_refused():
    model = Wrapper(keras.Sequential([keras.layers.Dense(4, name="twin")]))
    model.inner.add(keras.layers.Dense(4, name="other"))
    model.build((None, 4))
    nested = Wrapper(keras.Sequential([keras.layers.Dense(4, name="twin")]))
    nested.build((None, 4))
    both = keras.Sequential([model, nested])
    both.build((None, 4))
    with pytest.raises(PlanError, match="twin"):
        rematerialize(both, ["twin"])


def test_sequence_parallelism_reaches_a_wrapped_backbone():
    # Its families are the backbone's layers too: tokens cut between
    # tensor-parallel regions, the compiled peak lower (1x4: 27.31 MB ->
    # 21.72 MB), and the same numbers as one device.
    x = zoo.token_inputs(1024)
    y = zoo.random_targets(_wrapped_gpt2, x)
    mesh = MeshSpec((1, 4), ("batch", "model"))
    with_sequence = plan(_wrapped_gpt2, mesh, x, sequence_parallel=True)
    assert any(
        lever.startswith("sequence parallelism") and "/transformer_layer_0" in lever
        for lever in with_sequence.estimate.levers
    ), with_sequence.notes
    without = plan(_wrapped_gpt2, mesh, x)
    peaks = [
        compiled_peak_bytes(
            compiled_as_planned(p, _wrapped_gpt2, x, y).train_step.memory
        )
        for p in (without, with_sequence)
    ]
    assert peaks[1] < peaks[0], peaks
    check_parity(_wrapped_gpt2, plan_distribution(with_sequence), x, y, steps=2)
