"""The plan's notes in words (`planner/notes.py`)."""

import numpy as np

from keras_autoshard.planner.notes import uneven_state_note
from keras_autoshard.planner.planner import plan
from keras_autoshard.plans.sharding_plan import MeshSpec
from tests.planner.small_models import BATCH, TOKENS, blocks_model


def test_variables_held_unevenly_are_named_largest_first():
    sharding_plan = plan(
        blocks_model,
        MeshSpec((2, 4), ("batch", "model")),
        np.zeros((BATCH, TOKENS), "int32"),
    )
    note = uneven_state_note(sharding_plan)
    # 20224 bytes over 8 devices is 2528 even; each holds 7552.
    assert note.startswith("Variables per device are 2.99x an even cut over 8 devices")
    assert (
        "(7.38 KiB against 2.47 KiB): kept whole are table/embeddings (3.12 KiB), "
        "block/down/bias (64 B), block_1/down/bias (64 B);"
    ) in note
    assert note.endswith("and no memory budget asks for it.")


def test_a_single_device_needs_no_note():
    sharding_plan = plan(
        blocks_model,
        MeshSpec((1, 1), ("batch", "model")),
        np.zeros((BATCH, TOKENS), "int32"),
    )
    assert uneven_state_note(sharding_plan) is None
