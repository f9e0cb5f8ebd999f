"""`PlanRequest`: `plan()`'s keyword arguments as one object, checked before
any tracing and turned into the search's `PlannerOptions`."""

import pytest

from keras_autoshard.errors import PlanError
from keras_autoshard.planner.cost_model import PlannerOptions
from keras_autoshard.planner.plan_request import PlanRequest
from keras_autoshard.plans.hardware import hardware_profile


def test_the_defaults_are_plans():
    request = PlanRequest()
    request.check()
    assert not request.budget_asked
    assert request.profile() is None


@pytest.mark.parametrize(
    "request_, error, message",
    [
        (PlanRequest(job="serve"), ValueError, "job='serve': use one of"),
        (
            PlanRequest(sequence_parallel="on"),
            ValueError,
            "sequence_parallel='on': use one of",
        ),
        (
            PlanRequest(gradient_accumulation_steps=0),
            PlanError,
            "gradient_accumulation_steps=0: use None",
        ),
    ],
)
def test_a_request_no_plan_can_answer_is_refused(request_, error, message):
    with pytest.raises(error, match=message):
        request_.check()


def test_the_budget_asked_for_wins_over_the_profiles():
    profile = hardware_profile("h100-80gb")
    request = PlanRequest(memory_budget="1GiB", hardware="h100-80gb")
    assert request.budget_asked
    assert request.profile() == profile
    assert request.budget_bytes(profile) == 2**30
    assert PlanRequest().budget_bytes(profile) == profile.memory_budget_bytes


def test_planner_options_carry_the_request():
    request = PlanRequest(
        optimizer_slots=1,
        job="inference",
        rematerialize=["layer_0"],
        sequence_parallel="auto",
        gradient_accumulation_steps=2,
        batch_over_model_axes=False,
    )
    assert request.planner_options(1000, "gpu", None) == PlannerOptions(
        memory_budget_bytes=1000,
        optimizer_slots=1,
        platform="gpu",
        job="inference",
        rematerialize=("layer_0",),
        sequence_parallel="auto",
        gradient_accumulation_steps=2,
        batch_over_model_axes=False,
    )
