"""The notes and messages of a plan: its estimated peak against the budget,
why variables are held unevenly, why nothing fits.

Text only, from plain data (`PlanEstimate`, `ShardingPlan`); the planner
decides, these functions say what it decided.
"""

from __future__ import annotations

from keras_autoshard.planner.levers import ASKED, NoFit
from keras_autoshard.plans.estimate import (
    XLA_GPU_MEMORY_SHARE,
    XLA_GPU_SLOP_FACTOR,
    PlanEstimate,
    usable_budget,
)
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan
from keras_autoshard.plans.units import format_bytes

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


def memory_note(estimate: PlanEstimate) -> str:
    """The estimated peak per device, against the budget when there is one,
    and the levers chosen."""
    peak = format_bytes(estimate.peak_bytes)
    job = {"train": "a training step", "generate": "generation"}.get(
        estimate.job, "inference"
    )
    levers = "".join(
        f" Lever: {lever}." if lever.endswith(ASKED) else f" Chosen to fit: {lever}."
        for lever in estimate.levers
    )
    if estimate.budget_bytes is None:
        return (
            f"Estimated peak per device of {job}: {peak} ({_parts(estimate)})." + levers
        )
    usable = estimate.usable_bytes
    budget = (
        f"the budget {format_bytes(estimate.budget_bytes)} (plans fill at most "
        f"{format_bytes(usable)} of it{_limit_clause(estimate)})"
    )
    if estimate.peak_bytes <= usable:
        return (
            f"Estimated peak per device {peak} fits {budget} ({_parts(estimate)})."
            + levers
        )
    over = format_bytes(estimate.peak_bytes - usable)
    return (
        f"Estimated peak per device {peak} EXCEEDS {budget} by {over} "
        f"({_parts(estimate)})." + levers
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
