"""The reduction XLA:GPU combines with the loss's and holds to the step's
end (`planner/loss_reduction.py`): a Dense head whose outputs `model` cuts
(its input's gradient), and an embedding table read again as the output
projection with the batch cut over `model` (the projection's gradient).
Checked on models written here, compiled deviceless for 8 H100s on 1x8."""

import functools
import re

import jax
import keras
import numpy as np
import pytest

import keras_autoshard as ka
from keras_autoshard.apply.jax.target_compile import compile_for_target
from keras_autoshard.report.estimate_check import (
    compiled_io_bytes,
    compiled_peak_bytes,
)
from tests.planner.small_models import TableTwice

BATCH, TOKENS, WIDTH, CLASSES, VOCABULARY = 8, 64, 128, 16, 1024
MESH = ka.MeshSpec((1, 8), ("batch", "model"))


def dense_head():
    model = keras.Sequential(
        [
            keras.layers.Dense(4 * WIDTH, activation="gelu", name="wide"),
            keras.layers.Dense(WIDTH, name="narrow"),
            keras.layers.Dense(CLASSES, name="head"),
        ]
    )
    model.build((None, TOKENS, WIDTH))
    return model


def table_twice():
    model = TableTwice(VOCABULARY, WIDTH)
    model.build((None, TOKENS))
    return model


# case -> (builder, features, targets, the reduced gradient's elements)
CASES = {
    "dense head": (
        dense_head,
        jax.ShapeDtypeStruct((BATCH, TOKENS, WIDTH), np.float32),
        jax.ShapeDtypeStruct((BATCH, TOKENS, CLASSES), np.float32),
        BATCH * TOKENS * WIDTH,
    ),
    "table twice": (
        table_twice,
        jax.ShapeDtypeStruct((BATCH, TOKENS), np.int32),
        jax.ShapeDtypeStruct((BATCH, TOKENS, VOCABULARY), np.float32),
        VOCABULARY * WIDTH,
    ),
}


@functools.cache
def compiled(case: str):
    """(plan, compiled step) of one case, compiled once per session."""
    build, features, targets, _ = CASES[case]
    plan = ka.plan(build, MESH, features, hardware="h100-80gb")
    step = compile_for_target(build, plan, (features, targets), "h100-80gb")
    return plan, step.step


def combined_all_reduces(hlo: str) -> dict[str, int]:
    """All-reduces of the entry computation whose operand is a
    concatenation: name -> elements."""
    entry = hlo[hlo.index("\nENTRY ") :]
    return {
        name: int(size)
        for name, size in re.findall(
            r"%(all-reduce-start[.\d]*) = f32\[(\d+)\]\S* all-reduce-start\("
            r"%wrapped_concatenate",
            entry,
        )
    }


def read_after_updates_begin(hlo: str, start: str) -> bool:
    """Whether the all-reduce `start`'s result is read by an instruction of
    the entry computation (printed in schedule order) after the first
    optimizer update."""
    entry = hlo[hlo.index("\nENTRY ") :].splitlines()
    # Keras numbers a process's later optimizers: `adam_1`, ...
    first_update = next(
        i for i, line in enumerate(entry) if re.search(r"/adam(_\d+)?/", line)
    )
    done = next(
        re.match(r"\s*%(\S+) = ", line).group(1)
        for line in entry
        if re.search(rf"all-reduce-done\(%{re.escape(start)}\)", line)
    )
    return any(
        re.search(rf"%{re.escape(done)}[,)]", line) for line in entry[first_update:]
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_loss_reduction_rides_with_a_gradient_to_the_steps_end(case):
    """The loss's own sums (a few values) are packed with the head's
    reduced gradient into one all-reduce, whose result the step still reads
    once the updates have begun: the whole gradient's buffer held to the
    end."""
    _, step = compiled(case)
    elements = CASES[case][3]
    combined = {
        name: size
        for name, size in combined_all_reduces(step.hlo_text).items()
        if 0 < size - elements <= BATCH * TOKENS
    }
    assert combined, combined_all_reduces(step.hlo_text)
    assert any(read_after_updates_begin(step.hlo_text, n) for n in combined)


def test_the_estimate_holds_the_combined_reduction():
    """Measured (estimate / compiled peak): the table read twice 0.87
    before the held reduction was counted, 1.00 with it (its 512 KiB
    gradient held from the projection's backward pass to the end; the
    zoo's tied model on 1x8, a tanh where this has a ReLU, 0.81 -> 0.94)."""
    plan, step = compiled("table twice")
    ratio = plan.estimate.peak_bytes / compiled_peak_bytes(step.memory)
    assert 0.9 <= ratio <= 1.1, (plan.estimate.to_dict(), ratio)


def test_the_dense_head_where_memory_binds():
    """Measured (estimate / compiled peak) for the dense head: 0.76 before
    the held reduction was counted (its input's 256 KiB gradient), 0.89
    with it. The rest, 0.5 MiB, is the narrow layer's weight gradient in 16
    partial products, which XLA:GPU's update sums as it reads them and its
    latency-hiding schedule, with 80 GB free, runs after the wide layer's
    partials are made: both held at once. Compiled again for GPUs whose
    memory puts XLA:GPU's program limit at the estimate, it makes the
    narrow layer's product again just before its update (the
    `memory_truth_gpu` figure for rows outside ±10 %): the estimate is
    0.95 of that program's peak (0.81 before)."""
    from benchmarks.memory_truth_gpu import compiled_peak_under_limit

    plan, step = compiled("dense head")
    compiled_peak = compiled_peak_bytes(step.memory)
    assert 0.85 <= plan.estimate.peak_bytes / compiled_peak <= 1.1
    io_bytes = compiled_io_bytes(step.memory)
    features = CASES["dense head"][1]
    limited = compiled_peak_under_limit(
        dense_head, plan, features, plan.estimate.peak_bytes, io_bytes
    )
    ratio = plan.estimate.peak_bytes / limited
    assert 0.9 <= ratio <= 1.1, (plan.estimate.to_dict(), limited, ratio)
