"""XLA:GPU's own memory limit, planned for: a plan for a GPU stays under the
peak XLA:GPU keeps a program under by itself (`xla_gpu_program_limit`), so
the program XLA:GPU compiles is the one the estimate follows, not one XLA
recomputed by itself; and the step's arguments are what the estimate says.

The device here is described to XLA:GPU with 1000 MiB of memory (the H100's
description otherwise), so a model of a few hundred MiB meets the limit; the
compile is deviceless, nothing is allocated."""

import dataclasses
import pathlib
import re

import jax
import keras
import numpy as np
import pytest

import keras_autoshard as ka
from keras_autoshard.apply.jax.target_compile import compile_for_target
from keras_autoshard.errors import PlanError
from keras_autoshard.plans.estimate import usable_budget, xla_gpu_program_limit
from keras_autoshard.plans.hardware import HardwareProfile
from keras_autoshard.runtime import gpu_targets

MIB = 2**20
DEVICE_MEMORY = 1000 * MIB
BATCH, WIDTH, LAYERS = 32768, 2048, 8
MESH = ka.MeshSpec((2, 4), ("batch", "model"))


def build_mlp():
    inputs = keras.Input((WIDTH,))
    hidden = inputs
    for index in range(LAYERS):
        hidden = keras.layers.Dense(WIDTH, activation="gelu", name=f"dense_{index}")(
            hidden
        )
    return keras.Model(inputs, hidden)


SAMPLE = jax.ShapeDtypeStruct((BATCH, WIDTH), np.float32)


@pytest.fixture(scope="module")
def small_gpu(tmp_path_factory) -> HardwareProfile:
    """An H100 described to XLA:GPU with 1000 MiB of memory."""
    text = gpu_targets.target_description("h100-80gb")
    text = re.sub(
        r"device_memory_size: \d+", f"device_memory_size: {DEVICE_MEMORY}", text
    )
    path = pathlib.Path(tmp_path_factory.mktemp("target")) / "small.textproto"
    path.write_text(text)
    return HardwareProfile(
        "h100-1000mib", "gpu", DEVICE_MEMORY, 989e12, 450e9, 50e9, 8,
        "an H100 described with 1000 MiB of memory", str(path),
    )  # fmt: skip


@pytest.fixture(scope="module")
def planned(small_gpu):
    return ka.plan(
        build_mlp, MESH, SAMPLE, hardware=small_gpu, memory_budget=DEVICE_MEMORY
    )


@pytest.fixture(scope="module")
def compiled(small_gpu, planned):
    return compile_for_target(build_mlp, planned, (SAMPLE, SAMPLE), small_gpu)


# What `HloRematerialization` recomputes when it finds no value to: a
# device's partition id (`test_a_plan_stays_under_xla_gpus_limit_...`).
PARTITION_ID = "u32[] partition-id"


def _recomputed(hlo_text: str) -> list[str]:
    """`"<shape> <opcode>"` of each instruction XLA:GPU recomputed by itself
    (`%name.remat = shape opcode(...)` in the optimized HLO)."""
    return re.findall(r"%\S+\.remat\d* = (.*?)\(", hlo_text)


def test_the_limit_is_xla_gpus_formula_on_the_description_s_memory(small_gpu, planned):
    """The limit is read off the target description (what XLA:GPU reads),
    and it is under what the budget's headroom alone would let plans fill:
    the premise of this file (a whole device as the budget)."""
    assert gpu_targets.device_memory_size(small_gpu) == DEVICE_MEMORY
    assert gpu_targets.device_memory_size("h100-80gb") == 85_520_809_984
    estimate = planned.estimate
    limit = xla_gpu_program_limit(DEVICE_MEMORY, estimate.io_bytes)
    assert estimate.compiler_limit_bytes == limit
    assert limit < usable_budget(DEVICE_MEMORY, "XLA:GPU")
    assert estimate.usable_bytes == limit


def test_a_plan_stays_under_xla_gpus_limit_and_xla_recomputes_nothing(
    planned, compiled
):
    """The plan's levers bring its peak under XLA:GPU's limit, and XLA:GPU
    then recomputes no value of the step by itself (every `.remat`
    instruction of the optimized HLO is a device's partition id, a 4-byte
    scalar); the compiled program fits the budget.

    XLA:GPU's `HloRematerialization` measures the program before its last
    passes, above what the compiled program holds: for this plan (every
    layer rematerialized, its stored cuts drifting into the stream) 596 MiB
    of temporaries against its limit of 519 MiB, where the compiled
    program holds 434 MiB (its peak 738 MiB, estimated 702 MiB). Finding
    no value to recompute, it recomputes the partition id. The plan made
    before recomputed activations were counted cut as XLA holds them
    (6 layers rematerialized, 2 micro-batches; compiled peak 785 MiB) was
    over that measure too (657 against 645 MiB), and recomputed nothing."""
    estimate = planned.estimate
    assert estimate.fits and estimate.peak_bytes <= estimate.compiler_limit_bytes
    assert planned.rematerialize, "the model does not reach the limit"
    recomputed = _recomputed(compiled.step.hlo_text)
    assert set(recomputed) <= {PARTITION_ID}, recomputed
    assert compiled.compiled_peak_bytes <= DEVICE_MEMORY


def test_the_same_sharding_without_its_levers_is_recomputed_by_xla(small_gpu, planned):
    """Without the plan's levers the program is over XLA:GPU's limit, and
    XLA:GPU recomputes values by itself: the limit is real, and a plan over
    it would not be the program its estimate and step time describe."""
    bare = dataclasses.replace(planned, rematerialize=(), gradient_accumulation_steps=1)
    result = compile_for_target(build_mlp, bare, (SAMPLE, SAMPLE), small_gpu)
    assert set(_recomputed(result.step.hlo_text)) - {PARTITION_ID}


def test_the_step_is_given_what_the_estimate_counts_as_its_arguments(planned, compiled):
    """Arguments of the compiled step (variables, optimizer state, one
    micro-batch of inputs and targets) against `io_bytes`: Keras lays the
    data out over the data axis only, whatever the plan cuts the batch by
    inside the step (counted by the plan's cut, the inputs were 96 MiB
    short here)."""
    arguments = compiled.step.memory["argument_bytes"]
    assert abs(arguments - planned.estimate.io_bytes) <= MIB, (
        arguments,
        planned.estimate.to_dict(),
    )


def test_a_plan_asked_to_keep_every_activation_names_xla_gpus_limit(small_gpu):
    """Asked for no rematerialization and no accumulation, no plan fits
    under XLA:GPU's limit: the error says so, naming the limit."""
    with pytest.raises(PlanError, match="XLA:GPU's own limit"):
        ka.plan(
            build_mlp,
            MESH,
            SAMPLE,
            hardware=small_gpu,
            memory_budget=DEVICE_MEMORY,
            rematerialize="none",
            gradient_accumulation_steps=1,
        )
