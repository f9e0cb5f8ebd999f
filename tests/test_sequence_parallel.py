"""Sequence parallelism (Megatron-SP) as the plan applies it.

On a (1, 4) and a (2, 4) mesh, a KerasHub GPT-2 backbone planned with
`sequence_parallel=True` against the same model planned without:

- the compiled train step needs less memory at its peak (XLA memory
  analysis, scheduled for memory as accelerators do: `MEMORY_SCHEDULE_ON_CPU`);
- its collectives send no more than 5 % more bytes on the wire (ring
  algorithms, `CollectiveOp.ring_bytes`; XLA:CPU writes each reduce-scatter
  as an all-reduce sliced by partition, counted as the reduce-scatter it is);
- 5 Adam steps match one device within 1e-5.

And the rules that choose where it applies, on models written here.
"""

import keras
import numpy as np
import pytest

from keras_autoshard import (
    MeshSpec,
    PlanDistribution,
    make_device_mesh,
    names_replayed_after,
    plan,
)

from keras_autoshard.report.compiled_program import (
    MEMORY_SCHEDULE_ON_CPU,
    inspect_compiled,
)
from keras_autoshard.report.estimate_check import compiled_peak_bytes
from tests.parity import check_parity

SEQ = 128
WIRE_TOLERANCE = 0.05


def _gpt2():
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=1024,
        num_layers=2,
        num_heads=8,
        hidden_dim=256,
        intermediate_dim=1024,
        max_sequence_length=SEQ,
    )


def _batch(batch=8, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(0, 1024, (batch, SEQ)).astype("int32"),
        "padding_mask": np.ones((batch, SEQ), "int32"),
    }
    y = rng.standard_normal((batch, SEQ, 256)).astype("float32")
    return x, y


def _distribution(sharding_plan):
    devices = keras.distribution.list_devices()[: sharding_plan.mesh.device_count]
    return PlanDistribution(
        sharding_plan, make_device_mesh(sharding_plan.mesh, devices)
    )


def _compiled(sharding_plan, x, y):
    distribution = _distribution(sharding_plan)
    with distribution.scope(), names_replayed_after():
        model = _gpt2()
        model.compile(optimizer="adam", loss="mse")
    report = inspect_compiled(
        model, distribution, (x, y), compiler_options=MEMORY_SCHEDULE_ON_CPU
    )
    return report.train_step


@pytest.mark.parametrize("shape", [(1, 4), (2, 4)], ids=["1x4", "2x4"])
def test_sequence_parallel_lowers_the_compiled_peak_at_the_same_wire_bytes(shape):
    mesh = MeshSpec(shape, ("batch", "model"))
    x, y = _batch()
    tensor_parallel = plan(_gpt2, mesh, x)
    sequence_parallel = plan(_gpt2, mesh, x, sequence_parallel=True)

    assert sequence_parallel.variables == tensor_parallel.variables
    assert any(
        "sequence parallelism" in lever for lever in sequence_parallel.estimate.levers
    )
    assert (
        sequence_parallel.estimate.activation_bytes
        < tensor_parallel.estimate.activation_bytes
    )
    pinned = {a.path: a.spec for a in sequence_parallel.activations}
    # Between the parallel regions the tokens are cut; a row-parallel
    # output stays whole, a column-parallel one keeps its planned cut.
    assert pinned["transformer_layer_0/output"][1] == "model"
    assert pinned["transformer_layer_1/self_attention_layer_norm/output"][1] == "model"
    assert "model" not in pinned["transformer_layer_0/feedforward_output_dense/output"]
    assert pinned["transformer_layer_0/feedforward_intermediate_dense/output"][2] == (
        "model"
    )

    without = _compiled(tensor_parallel, x, y)
    with_sequence = _compiled(sequence_parallel, x, y)

    peak_without = compiled_peak_bytes(without.memory)
    peak_with = compiled_peak_bytes(with_sequence.memory)
    assert with_sequence.memory["temp_bytes"] < without.memory["temp_bytes"]
    assert peak_with < peak_without, (peak_with, peak_without)
    wire_without = sum(op.ring_bytes for op in without.collectives)
    wire_with = sum(op.ring_bytes for op in with_sequence.collectives)
    assert wire_with <= (1 + WIRE_TOLERANCE) * wire_without, (wire_with, wire_without)
    # The reduce-scatters are there (as sliced all-reduces on XLA:CPU), and
    # the all-gathers that open each parallel region.
    assert sum(op.scattered_bytes for op in with_sequence.collectives) > 0
    assert any(op.kind == "all-gather" for op in with_sequence.collectives)
    assert not any(op.kind == "all-to-all" for op in with_sequence.collectives)

    check_parity(_gpt2, _distribution(sequence_parallel), x, y, steps=5)
