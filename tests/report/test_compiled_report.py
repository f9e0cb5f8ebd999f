"""The compiled-program report is exact: Megatron collectives of the MLP block."""

import functools
import json
import re

from keras_autoshard import PlanDistribution, inspect_compiled
from keras_autoshard.testing import zoo
from tests.apply.test_parity_handwritten import mlp_plan
from tests.xla_flags import SUITE_XLA_FLAGS

BATCH, SEQ, HIDDEN = zoo.BATCH, zoo.MLP_SEQ, zoo.HIDDEN
DATA, MODEL = 2, 4
FP32 = 4
# One all-reduce moves the per-device activation: (batch / data) x seq x hidden.
ACTIVATION_BYTES = (BATCH // DATA) * SEQ * HIDDEN * FP32


def _report(with_forward_step=True):
    plan = mlp_plan()
    dist = PlanDistribution(plan)
    x, y = zoo.mlp_batch()
    with dist.scope():
        model = zoo.build_mlp_block()
        model.compile(optimizer="adam", loss="mse")
        report = inspect_compiled(
            model, dist, (x, y), with_forward_step=with_forward_step
        )
    return plan, report


def _expected_param_bytes_per_device():
    norm = 2 * HIDDEN
    up = HIDDEN * 4 * HIDDEN // MODEL + 4 * HIDDEN // MODEL
    down = 4 * HIDDEN * HIDDEN // MODEL + HIDDEN
    return (norm + up + down) * FP32


def test_mlp_report_has_exactly_the_megatron_collectives():
    _, report = _report()
    forward = report.forward_step
    assert forward.count() == 1
    assert forward.count("all-reduce", ("model",)) == 1
    assert forward.operand_bytes("all-reduce", ("model",)) == ACTIVATION_BYTES

    train = report.train_step
    kinds = {op.kind for op in train.collectives}
    assert kinds == {"all-reduce"}
    # Forward row-parallel output + backward column-parallel input gradient.
    assert train.count("all-reduce", ("model",)) == 2
    assert train.operand_bytes("all-reduce", ("model",)) == 2 * ACTIVATION_BYTES
    # Gradient sync over the data axis: every local gradient shard once, plus
    # the scalar loss.
    assert train.count("all-reduce", ("batch",)) == 1
    assert (
        train.operand_bytes("all-reduce", ("batch",))
        == _expected_param_bytes_per_device() + FP32
    )
    assert train.count() == 3
    # On a ring, each all-reduce over the 4 model devices sends 2 * 3/4 of
    # the activation (the MLP's output stays whole: nothing is scattered).
    assert train.ring_bytes("all-reduce", ("model",)) == 2 * (2 * 3 / 4) * (
        ACTIVATION_BYTES
    )


def test_report_parameter_and_optimizer_bytes_match_the_plan():
    plan, report = _report()
    assert report.parameter_bytes_per_device == plan.bytes_per_device()
    assert report.parameter_bytes_per_device == _expected_param_bytes_per_device()
    # Adam: two slots per parameter with the same layout, plus two scalars.
    assert report.optimizer_bytes_per_device == 2 * plan.bytes_per_device() + 2 * 4
    for shards in report.parameters:
        planned = plan.variable(shards.path)
        assert set(shards.bytes_by_device) == {planned.bytes_per_device(plan.mesh)}
        assert shards.spec == planned.spec


def test_report_serialises_to_json_and_prints_a_table():
    _, report = _report()
    data = json.loads(report.to_json())
    assert data["parameter_bytes_per_device"] == _expected_param_bytes_per_device()
    summary = data["train_step"]["collective_summary"]
    by_axes = {tuple(row["mesh_axes"]): row for row in summary}
    assert by_axes[("model",)]["count"] == 2
    assert data["train_step"]["memory"]["argument_bytes"] > 0
    text = report.table()
    assert "train_step" in text and "forward_step" in text
    assert "all-reduce" in text
    assert "ring bytes sent/device" in text
    assert by_axes[("model",)]["ring_bytes"] == 2 * (2 * 3 / 4) * ACTIVATION_BYTES


def test_a_report_of_the_train_step_alone_is_the_same_train_step():
    _, both = _report()
    _, train_only = _report(with_forward_step=False)
    assert train_only.forward_step is None
    assert train_only.steps == (train_only.train_step,)
    assert train_only.train_step.collectives == both.train_step.collectives
    assert train_only.train_step.memory == both.train_step.memory
    assert train_only.parameters == both.parameters
    text = train_only.table()
    assert "train_step" in text and "forward_step" not in text
    assert json.loads(train_only.to_json())["forward_step"] is None


def test_inspect_compiled_plans_an_auto_shard_distribution_on_the_sample_batch():
    import keras_autoshard as ka

    dist = ka.AutoShardDistribution(device_mesh=ka.MeshSpec((2, 4), ("batch", "model")))
    x, y = zoo.mlp_batch()
    with dist.scope():
        model = zoo.build_mlp_block()
        model.compile(optimizer="adam", loss="mse")
    assert not dist.is_planned
    report = inspect_compiled(model, dist, (x, y))
    assert dist.is_planned and dist.plan.batch_axis == "batch"
    assert report.train_step.count("all-reduce", ("model",)) >= 1
    expected = sum(v.bytes_per_device(dist.plan.mesh) for v in dist.plan.variables)
    assert report.parameter_bytes_per_device == expected


def _without_source_locations(hlo_text: str) -> str:
    """The program without where its ops were written (the file, function
    and stack-frame tables after the module's header, and each
    instruction's `metadata={...}`): an executable from JAX's compilation
    cache carries the source locations of the compile that stored it, which
    may be another test's."""
    tables = r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(\d+ .*\n)*"
    program = re.sub(tables, "", hlo_text, flags=re.MULTILINE)
    return re.sub(r", metadata=\{[^}]*\}", "", program)


@functools.lru_cache(maxsize=1)
def _rematerialized_gpt2():
    """A planned GPT-2 with every layer rematerialized on 2x4, its
    distribution and batch, and a function compiling its train and forward
    steps scheduled for memory as the memory tests read them, under extra
    compiler options: `[(optimized HLO without source locations, memory
    analysis), ...]`."""
    from keras_autoshard import MeshSpec, plan
    from keras_autoshard.apply.as_planned import compile_as_planned
    from keras_autoshard.report.compiled_program import MEMORY_SCHEDULE_ON_CPU

    build, batch = zoo.ZOO["gpt2"]
    x = batch()
    y = zoo.random_targets(build, x)
    sharding_plan = plan(
        build, MeshSpec((2, 4), ("batch", "model")), x, rematerialize="all"
    )
    assert sharding_plan.rematerialize
    dist = PlanDistribution(sharding_plan)
    with dist.scope():
        model = build()
        compile_as_planned(model, sharding_plan)

    programs = {}

    def program(options):
        key = tuple(sorted(options.items()))
        if key not in programs:
            report = inspect_compiled(
                model, dist, (x, y), {**MEMORY_SCHEDULE_ON_CPU, **options}
            )
            programs[key] = [
                (_without_source_locations(step.hlo_text), step.memory)
                for step in (report.train_step, report.forward_step)
            ]
        return programs[key]

    return program


def test_reports_read_the_program_the_default_code_level_makes():
    """`inspect_compiled` compiles at the lowest backend optimization level
    (`READ_NOT_RUN`: its programs are read, never run): on a planned GPT-2's
    train step, rematerialized layers and all, scheduled for memory as the
    memory tests read it, the optimized HLO and the memory analysis are
    those of the default level (3). A flag that changes an HLO pass is seen
    (`xla_disable_hlo_passes=fusion`), so the comparison can fail."""
    from keras_autoshard.report.compiled_program import READ_NOT_RUN

    assert READ_NOT_RUN == {"xla_backend_optimization_level": 0}
    program = _rematerialized_gpt2()
    read = program({})
    assert read == program({"xla_backend_optimization_level": 3})
    assert read[0][1]["temp_bytes"] > 0
    other_passes = program({"xla_disable_hlo_passes": "cse_barrier_expander,fusion"})
    assert [text for text, _ in other_passes] != [text for text, _ in read]


_COLLECTIVE = re.compile(
    r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\("
)


def test_the_suites_fusion_emitters_change_no_collective_and_few_bytes():
    """The suite compiles XLA:CPU's fusions with its elemental emitters
    (`tests/xla_flags.py`: `--xla_cpu_use_fusion_emitters=false`, half the
    compile time). What the tests read stays: the same collectives with the
    same shapes, the same argument, output and aliased bytes, and temporary
    bytes within 3 % (XLA:CPU's default emitters wrap each unfused
    instruction in a fusion of its own, which moves the memory scheduler's
    ties: on GPT-2 here 128 bytes; the most over the zoo's train steps on
    three meshes, free and rematerialized, was the Llama's free plan on 2x4,
    6,280,680 -> 6,449,640 bytes, +2.7 %)."""
    assert "--xla_cpu_use_fusion_emitters=false" in SUITE_XLA_FLAGS
    program = _rematerialized_gpt2()
    suite = program({})  # this process's XLA_FLAGS hold the suite's
    default = program({"xla_cpu_use_fusion_emitters": True})
    for (suite_text, suite_memory), (default_text, default_memory) in zip(
        suite, default
    ):
        assert suite_text != default_text  # the emitters' wrapped fusions
        collectives = sorted(_COLLECTIVE.findall(suite_text))
        assert collectives == sorted(_COLLECTIVE.findall(default_text))
        for key in ("argument_bytes", "output_bytes", "alias_bytes"):
            assert suite_memory[key] == default_memory[key], key
        difference = abs(suite_memory["temp_bytes"] - default_memory["temp_bytes"])
        assert difference <= 0.03 * default_memory["temp_bytes"]
    assert sorted(_COLLECTIVE.findall(suite[0][0]))  # the train step has some
