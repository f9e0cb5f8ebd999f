"""Planning a small model end to end, without compiling it
(`planner/planner.py`, through `plan`)."""

import numpy as np

from keras_autoshard.planner.planner import plan
from keras_autoshard.plans.sharding_plan import MeshSpec
from tests.planner.small_models import BATCH, TOKENS, blocks_model

MESH = MeshSpec((2, 4), ("batch", "model"))


def test_two_mlp_blocks_on_2x4_are_cut_megatron_style():
    sharding_plan = plan(blocks_model, MESH, np.zeros((BATCH, TOKENS), "int32"))
    specs = {v.path: tuple(v.spec) for v in sharding_plan.variables}
    assert specs == {
        "table/embeddings": (None, None),
        "block/up/kernel": (None, "model"),
        "block/up/bias": ("model",),
        "block/down/kernel": ("model", None),
        "block/down/bias": (None,),
        "block_1/up/kernel": (None, "model"),
        "block_1/up/bias": ("model",),
        "block_1/down/kernel": ("model", None),
        "block_1/down/bias": (None,),
    }
    held = 4 * (50 * 16 + 2 * (16 * 64 + 64 + 64 * 16) // 4 + 2 * 16)
    assert sharding_plan.estimate.parameter_bytes == held
    assert sharding_plan.estimate.search.startswith("optimal")
