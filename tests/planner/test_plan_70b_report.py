"""The Llama-2-70B plan on 256 devices against Megatron-LM's arithmetic.

The figures checked here are the ones written out in docs/scaling.md; the
model is planned from shapes only (no weights allocated).
"""

from __future__ import annotations

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import jax  # noqa: E402

from keras_autoshard import MeshSpec  # noqa: E402
from keras_autoshard.planner.planner import plan_with_cost  # noqa: E402

LAYERS, HIDDEN, MLP, VOCAB = 80, 8192, 28672, 32000
HEADS, KV_HEADS, HEAD_DIM = 64, 8, 128
GLOBAL_BATCH, SEQ, FP32 = 256, 4096, 4
KV_WIDTH = KV_HEADS * HEAD_DIM
# Per layer: q and o (h x h), k and v (h x kv), three MLP kernels, two norms.
LAYER_MATRICES = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_WIDTH + 3 * HIDDEN * MLP
LAYER_NORMS = 2 * HIDDEN
TABLE = VOCAB * HIDDEN
EMBEDDINGS = 2 * TABLE  # untied input embedding and output head
TOTAL_PARAMETERS = LAYERS * (LAYER_MATRICES + LAYER_NORMS) + EMBEDDINGS + HIDDEN


def _build():
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=MLP,
    )


@pytest.fixture(scope="module", params=[(32, 8), (16, 16)], ids=["32x8", "16x16"])
def planned(request):
    data, model = request.param
    inputs = {
        name: jax.ShapeDtypeStruct((GLOBAL_BATCH, SEQ), np.int32)
        for name in ("token_ids", "padding_mask")
    }
    mesh = MeshSpec((data, model), ("batch", "model"))
    return data, model, plan_with_cost(_build, mesh, sample_input=inputs)


def test_the_model_has_llama_2_70b_parameter_count(planned):
    *_, result = planned
    assert TOTAL_PARAMETERS == 68_976_648_192
    assert result.plan.total_bytes() == TOTAL_PARAMETERS * FP32


def test_parameters_per_device_follow_megatron_tensor_parallel_arithmetic(planned):
    data, model, result = planned
    if KV_HEADS % model == 0:
        sharded, replicated = LAYER_MATRICES, LAYER_NORMS
    else:  # GQA: the K/V projections cannot split 8 heads 16 ways; replicated.
        sharded = LAYER_MATRICES - 2 * HIDDEN * KV_WIDTH
        replicated = LAYER_NORMS + 2 * HIDDEN * KV_WIDTH
    # The input embedding stays whole with no memory budget (sharding it
    # costs an all-reduce; see docs/scaling.md); the output head, which the
    # backbone never reads, is stored cut over every device at no cost.
    head = TABLE / (data * model)
    expected = FP32 * (LAYERS * (sharded / model + replicated) + TABLE + head + HIDDEN)
    assert result.cost.parameter_bytes == pytest.approx(expected, rel=1e-4)
    # No gradient for what is never read.
    assert result.cost.gradient_bytes == result.cost.parameter_bytes - FP32 * head
    assert result.cost.optimizer_bytes == 2 * result.cost.parameter_bytes  # Adam


def test_model_axis_moves_four_all_reduces_of_b_s_h_per_layer(planned):
    data, model, result = planned
    local_batch = GLOBAL_BATCH // data
    activation = local_batch * SEQ * HIDDEN * FP32
    megatron = LAYERS * 4 * activation  # 2 forward + 2 backward
    gqa = 0
    if KV_HEADS % model:  # backward all-reduce of the replicated K and V outputs
        gqa = LAYERS * 2 * local_batch * SEQ * KV_WIDTH * FP32
    assert result.cost.communication_by_axis["model"] == megatron + gqa
    if data == 32:
        assert megatron == 320 * 2**30


def test_data_axis_moves_about_one_gradient_all_reduce(planned):
    *_, result = planned
    ratio = result.cost.communication_by_axis["batch"] / result.cost.gradient_bytes
    assert 0.95 <= ratio <= 1.0
