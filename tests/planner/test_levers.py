"""`levers.Lever`: a lever is data (kind, description, asked), and its text
(`notes.lever_text`, what `PlanEstimate.levers` stores) and the memory
note's wording follow from it."""

import dataclasses

import pytest

from keras_autoshard.planner.levers import Lever
from keras_autoshard.planner.notes import (
    accumulation_description,
    lever_text,
    memory_note,
    remat_description,
)
from keras_autoshard.plans.estimate import PlanEstimate

REMAT = remat_description(("layer_0", "layer_1", "layer_2", "layer_3"))
ACCUMULATE = accumulation_description(2)


def test_a_lever_is_a_frozen_value():
    lever = Lever("rematerialize", REMAT, asked=True)
    assert lever == Lever("rematerialize", REMAT, asked=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lever.asked = False


def test_rematerialization_names_the_first_three_layers_and_the_last():
    assert REMAT == (
        "rematerialize 4 layer call(s) in the backward pass (jax.checkpoint, "
        "nothing saved inside): layer_0, layer_1, layer_2, … layer_3"
    )
    assert remat_description(("a",)).endswith("inside): a")


def test_a_lever_asked_for_says_so():
    assert lever_text(Lever("rematerialize", REMAT, asked=True)) == (
        REMAT + " (asked for)"
    )
    assert lever_text(Lever("accumulate", ACCUMULATE, asked=True)) == (
        ACCUMULATE + " (asked for)"
    )


def test_a_lever_chosen_to_fit_says_why_only_for_accumulation():
    assert lever_text(Lever("rematerialize", REMAT)) == REMAT
    assert lever_text(Lever("sequence_parallel", "sequence parallelism")) == (
        "sequence parallelism"
    )
    assert lever_text(Lever("accumulate", ACCUMULATE)) == (
        "gradient accumulation over 2 micro-batches: feed 1/2 of the planned "
        "batch per step with `gradient_accumulation_steps=2` on the optimizer "
        "(nothing else fits the whole batch)"
    )


def test_the_memory_note_tells_levers_asked_for_from_levers_chosen_to_fit():
    estimate = PlanEstimate(
        parameter_bytes=1024,
        gradient_bytes=1024,
        optimizer_bytes=2048,
        activation_bytes=0,
        data_bytes=0,
        transient_bytes=0,
    )
    levers = (
        Lever("rematerialize", REMAT, asked=True),
        Lever("accumulate", ACCUMULATE),
    )
    note = memory_note(estimate, levers)
    assert note.startswith("Estimated peak per device of a training step: 4.00 KiB")
    assert note.endswith(
        f" Lever: {REMAT} (asked for). Chosen to fit: {lever_text(levers[1])}."
    )
    assert memory_note(estimate).endswith(")."), "no levers, no lever text"
