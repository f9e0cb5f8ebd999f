"""The notes and messages of a plan: its estimated peak against the budget,
its levers in words (`lever_text`), why variables are held unevenly, why
nothing fits and what would.

Text only, from plain data (`PlanEstimate`, `ShardingPlan`); the planner
decides, these functions say what it decided.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from keras_autoshard.planner.gradient_reduction import COMBINE_THRESHOLD_BYTES
from keras_autoshard.plans.estimate import (
    XLA_GPU_MEMORY_SHARE,
    XLA_GPU_SLOP_FACTOR,
    PlanEstimate,
    usable_budget,
)
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan
from keras_autoshard.plans.units import format_bytes

if TYPE_CHECKING:
    from keras_autoshard.planner.levers import Lever, NoFit

# State per device above this multiple of an even cut is explained in a note.
UNEVEN_STATE = 1.1


def uneven_state_note(sharding_plan: ShardingPlan) -> str | None:
    """Why the variables per device exceed an even cut over every device by
    more than `UNEVEN_STATE`: the largest variables kept whole, named."""
    devices = sharding_plan.mesh.device_count
    even = sharding_plan.total_bytes() / devices
    held = sharding_plan.bytes_per_device()
    if devices == 1 or held <= UNEVEN_STATE * even:
        return None
    whole = sorted(
        (v for v in sharding_plan.variables if not any(v.spec)),
        key=lambda v: (-v.total_bytes, v.path),
    )[:3]
    named = ", ".join(f"{v.path} ({format_bytes(v.total_bytes)})" for v in whole)
    estimate = sharding_plan.estimate
    why = (
        "no memory budget asks for it"
        if estimate is None or estimate.budget_bytes is None
        else "the plan fits the budget without it"
    )
    return (
        f"Variables per device are {held / even:.2f}x an even cut over "
        f"{devices} devices ({format_bytes(held)} against "
        f"{format_bytes(even)}): kept whole are {named}; every cut of them "
        f"adds communication per step, and {why}."
    )


def _parts(estimate: PlanEstimate) -> str:
    return (
        f"parameters {format_bytes(estimate.parameter_bytes)}, gradients "
        f"{format_bytes(estimate.gradient_bytes)}, optimizer "
        f"{format_bytes(estimate.optimizer_bytes)}, activations kept for the "
        f"backward pass {format_bytes(estimate.activation_bytes)}, inputs and "
        f"targets {format_bytes(estimate.data_bytes)}, transient "
        f"{format_bytes(estimate.transient_bytes)}"
        + (
            f", key/value cache {format_bytes(estimate.cache_bytes)}"
            if estimate.job == "generate"
            else ""
        )
    )


def _limit_clause(estimate: PlanEstimate) -> str:
    """Why plans may fill no more of the budget than `usable_bytes`, where
    XLA:GPU's own limit is what binds (empty otherwise)."""
    headroom = usable_budget(estimate.budget_bytes or 0, estimate.compiler)
    if (estimate.usable_bytes or 0) >= headroom:
        return ""
    return (
        f", XLA:GPU's own limit for this program: "
        f"{XLA_GPU_MEMORY_SHARE * 100:.0f} % of the device's memory less the "
        f"step's arguments and outputs, times "
        f"{XLA_GPU_SLOP_FACTOR}, over which XLA:GPU recomputes values by itself"
    )


def memory_note(estimate: PlanEstimate, levers: Sequence[Lever] = ()) -> str:
    """The estimated peak per device, against the budget when there is one,
    and its `levers` (those asked for, and those chosen to fit)."""
    peak = format_bytes(estimate.peak_bytes)
    job = {"train": "a training step", "generate": "generation"}.get(
        estimate.job, "inference"
    )
    shown = "".join(
        f" Lever: {lever_text(lever)}."
        if lever.asked
        else f" Chosen to fit: {lever_text(lever)}."
        for lever in levers
    )
    if estimate.budget_bytes is None:
        return (
            f"Estimated peak per device of {job}: {peak} ({_parts(estimate)})." + shown
        )
    usable = estimate.usable_bytes
    budget = (
        f"the budget {format_bytes(estimate.budget_bytes)} (plans fill at most "
        f"{format_bytes(usable)} of it{_limit_clause(estimate)})"
    )
    if estimate.peak_bytes <= usable:
        return (
            f"Estimated peak per device {peak} fits {budget} ({_parts(estimate)})."
            + shown
        )
    over = format_bytes(estimate.peak_bytes - usable)
    return (
        f"Estimated peak per device {peak} EXCEEDS {budget} by {over} "
        f"({_parts(estimate)})." + shown
    )


def no_fit_message(mesh: MeshSpec, no_fit: NoFit) -> str:
    estimate = no_fit.best.estimate
    levers = "; ".join(estimate.levers) or "no rematerialization to offer"
    limit = _limit_clause(estimate)
    return (
        f"No plan fits the per-device budget of "
        f"{format_bytes(estimate.budget_bytes or 0)} (of which plans may fill "
        f"{format_bytes(estimate.usable_bytes or 0)}{limit}{'; ' if limit else ', '}"
        f"the rest kept for the estimate's error): the "
        f"least peak found, on "
        f"{mesh.describe()}, is {format_bytes(estimate.peak_bytes)}, over by "
        f"{format_bytes(no_fit.over_bytes)} ({_parts(estimate)}; levers: "
        f"{levers}). It would fit with {' or '.join(no_fit.suggestions)}."
    )


def no_plan_message(
    meshes: Sequence[MeshSpec],
    reasons: Sequence[str],
    memory_budget_bytes: int | None,
    rules: Mapping[str, object] | None,
) -> str:
    """Why no mesh has a plan at all (each mesh's solver reason), and with
    no budget, what in the rules to check."""
    described = ", ".join(m.describe() for m in meshes)
    if memory_budget_bytes is None:
        return (
            "No plan satisfies the rules and divisibility on "
            f"{described} (there is no memory "
            f"budget). {' '.join(reasons)} Check that each rule's spec can "
            "hold: its mesh axes divide the dimensions they cut, no mesh axis "
            "twice in one tensor, and tensors that must share a sharding "
            "(e.g. a kernel and the activation it makes) are not pinned to "
            f"conflicting axes. Rules given: {sorted(rules or {})}."
        )
    return f"No plan on {described}: {' '.join(reasons)}"


# Ends the text of a lever the user asked for rather than one chosen to fit.
ASKED = " (asked for)"
# Ends the text of gradient accumulation chosen to fit.
ACCUMULATION_CHOSEN = " (nothing else fits the whole batch)"


def lever_text(lever: Lever) -> str:
    """A lever in words, as the plan's estimate stores it (`PlanEstimate.levers`).

    Example:
        `lever_text(Lever("rematerialize", "rematerialize 2 layer call(s) …",
        asked=True))` ends with `" (asked for)"`.
    """
    if lever.asked:
        return lever.description + ASKED
    if lever.kind == "accumulate":
        return lever.description + ACCUMULATION_CHOSEN
    return lever.description


def remat_description(remat: Sequence[str]) -> str:
    """Rematerialization of the layer calls `remat`, in words."""
    shown = ", ".join(remat[:3]) + (f", … {remat[-1]}" if len(remat) > 3 else "")
    return (
        f"rematerialize {len(remat)} layer call(s) in the backward pass "
        f"(jax.checkpoint, nothing saved inside): {shown}"
    )


def accumulation_description(micro_batches: int) -> str:
    """Gradient accumulation over `micro_batches`, in words."""
    return (
        f"gradient accumulation over {micro_batches} micro-batches: feed "
        f"1/{micro_batches} of the planned batch per step with "
        f"`gradient_accumulation_steps={micro_batches}` on the optimizer"
    )


def fit_suggestions(mesh: MeshSpec, estimate: PlanEstimate) -> list[str]:
    """Changes that would fit the budget, in words, from the least-peak
    estimate on `mesh` (`NoFit.suggestions`)."""
    budget = estimate.usable_bytes or 0
    state = estimate.parameter_bytes + estimate.gradient_bytes
    state += estimate.optimizer_bytes
    per_batch = estimate.activation_bytes + estimate.data_bytes
    per_batch += estimate.transient_bytes + estimate.cache_bytes
    suggestions = []
    devices = mesh.device_count
    needed = devices * estimate.peak_bytes / max(budget, 1)
    suggestions.append(
        f"about {2 ** math.ceil(math.log2(max(needed, devices + 1)))} devices "
        f"instead of {devices} (state and batch cut further)"
    )
    if state < budget and per_batch > 0:
        steps = max(2, math.ceil(per_batch / (budget - state)))
        # Accumulating, the update writes every variable and its slots
        # anew beside the old (`memory_model`): twice the parameters and
        # their slots, and the accumulators; on XLA:CPU the accumulators
        # twice; on accelerators the gradients beside them and their
        # combined reduction's operand, at most `COMBINE_THRESHOLD_BYTES`,
        # where one accelerator's update reads each gradient as it is made
        # (`accelerator_peak`).
        parameters = estimate.parameter_bytes
        update = 2 * (parameters + estimate.optimizer_bytes) + parameters
        if estimate.compiler == "XLA:CPU":
            update += parameters
        elif devices > 1:
            update += parameters + min(parameters, COMBINE_THRESHOLD_BYTES)
        if estimate.job == "train" and update <= budget:
            suggestions.append(
                f"a batch {steps}x smaller per step, or gradient accumulation "
                f"over {steps} steps (`gradient_accumulation_steps={steps}` on "
                f"the optimizer, each step fed 1/{steps} of the batch)"
            )
        elif estimate.job == "train":
            suggestions.append(
                f"a batch {steps}x smaller per step (gradient accumulation "
                "would not fit: its update holds the variables and their "
                "optimizer slots twice)"
            )
        else:  # no optimizer to accumulate in: the batch, or the sequence
            suggestions.append(
                f"a batch {steps}x smaller per step (or shorter sequences: "
                "the largest activations"
                + (" and the key/value cache" if estimate.job == "generate" else "")
                + " grow with them)"
            )
    else:
        suggestions.append(
            f"the model's state alone ({format_bytes(state)} per device) "
            "exceeds the budget: only more devices (or a smaller optimizer "
            "state) help"
        )
    return suggestions
