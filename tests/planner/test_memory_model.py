"""The estimated peak per device (`planner/memory_model.py`), through
`estimate_memory`."""

import pytest

from keras_autoshard.planner.cost_model import Assignment
from keras_autoshard.planner.memory_model import estimate_memory
from tests.planner.small_models import AXES, batch_class, blocks_graph, param_class


def _megatron(graph):
    hidden = {param_class(graph, f"{b}/up/kernel", 1) for b in ("block", "block_1")}
    return Assignment({batch_class(graph): "batch", **dict.fromkeys(hidden, "model")})


def test_a_training_steps_state_activations_and_data_per_device():
    graph = blocks_graph()
    estimate = estimate_memory(graph, AXES, _megatron(graph))
    held = 4 * (50 * 16 + 2 * (16 * 64 + 64 + 64 * 16) // 4 + 2 * 16)
    assert (estimate.parameter_bytes, estimate.gradient_bytes) == (held, held)
    assert estimate.optimizer_bytes == 2 * held
    # Kept for the backward pass, half the batch on a device: the two block
    # inputs (2 x 8 x 16 floats each) and each block's ReLU output and
    # mask, its 64 features cut 4 ways (2 x 8 x 16 floats x 1.25).
    assert estimate.activation_bytes == 4 * (2 * 2 * 8 * 16 + 2 * 2 * 8 * 16 * 1.25)
    # Data: the token ids (2 x 8 int32) and targets as float32 (2 x 8 x 16).
    assert estimate.data_bytes == 4 * (2 * 8 + 2 * 8 * 16)
    assert estimate.job == "train"


def test_an_unknown_job_is_refused():
    graph = blocks_graph()
    with pytest.raises(ValueError, match="job='serve'"):
        estimate_memory(graph, AXES, _megatron(graph), job="serve")
