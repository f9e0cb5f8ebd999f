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


def _estimate(budget: int, compiler: str):
    from keras_autoshard.plans.estimate import PlanEstimate

    # 3 MiB of state and 2 MiB a batch: 5 MiB at the peak.
    return PlanEstimate(
        parameter_bytes=2**20,
        gradient_bytes=2**20,
        optimizer_bytes=2**20,
        activation_bytes=2**20,
        data_bytes=2**20,
        transient_bytes=0,
        budget_bytes=budget,
        compiler=compiler,
    )


def test_a_budget_the_headroom_takes_asks_for_a_larger_budget():
    """4.5 MiB for XLA:GPU leaves plans nothing (14 % and 8 MiB kept for
    the estimate's error): no number of devices helps, and the state is
    not over the budget itself; a budget of (5 + 8) / 0.86 MiB would do."""
    from keras_autoshard.planner.notes import fit_suggestions

    mesh = MeshSpec((2, 4), ("batch", "model"))
    (suggestion,) = fit_suggestions(mesh, _estimate(int(4.5 * 2**20), "XLA:GPU"))
    assert suggestion.startswith("a budget of at least 15.12 MiB per device")
    assert "plans may fill 0 B of 4.50 MiB" in suggestion
    # On XLA:CPU nothing is kept beside the 14 %: more devices, or a
    # smaller batch, as before.
    suggestions = fit_suggestions(mesh, _estimate(int(4.5 * 2**20), "XLA:CPU"))
    assert "devices instead of 8" in suggestions[0], suggestions
