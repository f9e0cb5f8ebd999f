"""Memory levers chosen together with the sharding.

For one mesh, the planner tries each rematerialization option
(`remat_options`: none, then the repeated-layer families of
`remat.remat_families` added one at a time, largest saving first). Each
option's search runs with the whole peak under the budget
(`peak_budget.py`); the option's plan is then estimated again in full
(`memory_model.py`). Among the plans that fit:

- with a hardware profile, the one of least estimated step time (compute,
  recomputation included, at the profile's FLOP/s plus communication at
  each axis's bandwidth);
- without one, the first that fits: the least recomputation.

The search and the check both keep `HEADROOM` of the budget free for the
estimate's error. Rematerialization is then trimmed to the fewest layers
of its last family that still fit (each layer recomputed costs a forward pass of it).

When no option fits, `NoFit` carries the plan of least peak (searched with
the peak as the objective) and the changes that would fit.
"""

from __future__ import annotations

import dataclasses
import math

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.cost_model import (
    Assignment,
    MeshAxis,
    PlanCost,
    PlannerOptions,
    evaluate,
)
from keras_autoshard.planner.linear_program import InfeasibleError
from keras_autoshard.planner.memory_model import (
    compute_flops_per_device,
    estimate_memory,
)
from keras_autoshard.planner.remat import remat_families
from keras_autoshard.planner.search import Pins, search
from keras_autoshard.plans.estimate import PlanEstimate
from keras_autoshard.plans.hardware import step_time_s
from keras_autoshard.plans.mesh import MeshSpec
from keras_autoshard.plans.plan_table import format_bytes

# Share of the budget the estimate must leave free: the estimate agrees with
# the compiled program's peak within about 10 % (measured on the test zoo,
# `tests/test_memory_estimate.py`, `tests/test_remat_fit.py`), so a plan
# estimated within 90 % of the budget compiles within it.
HEADROOM = 0.10


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One mesh's plan: its sharding, levers and estimate.

    Args:
        assignment: The sharding.
        remat: Names of the rematerialized layers, in call order.
        cost: Its communication and state bytes (`cost_model.evaluate`).
        estimate: The full per-device estimate, levers listed.
    """

    assignment: Assignment
    remat: tuple[str, ...]
    cost: PlanCost
    estimate: PlanEstimate


class NoFit(Exception):
    """No lever option fits the budget on this mesh.

    Args:
        best: The plan of least estimated peak (levers at their most).
        suggestions: Changes that would fit, in words.
    """

    def __init__(self, best: Candidate, suggestions: list[str]):
        self.best = best
        self.suggestions = suggestions
        super().__init__(
            f"the least peak found, {format_bytes(best.estimate.peak_bytes)}, "
            f"exceeds the budget by {format_bytes(self.over_bytes)}"
        )

    @property
    def over_bytes(self) -> int:
        """Bytes of peak above the usable budget (the budget less the
        estimate's headroom)."""
        return self.best.estimate.peak_bytes - usable_budget(
            self.best.estimate.budget_bytes or 0
        )


def usable_budget(budget: int) -> int:
    """The part of a budget a plan's estimate may fill (`HEADROOM` kept)."""
    return int(budget * (1 - HEADROOM))


def remat_options(graph: AxisGraph, job: str) -> list[tuple[str, ...]]:
    """Rematerialization options in order of recomputation.

    Args:
        graph: The model's axis graph.
        job: `"train"` or `"inference"` (nothing to rematerialize).

    Returns:
        Tuples of layer names: none first, then each family added.
    """
    options: list[tuple[str, ...]] = [()]
    if job != "train":
        return options
    for family in remat_families(graph):
        options.append(options[-1] + family)
    return options


def choose_levers(
    graph: AxisGraph,
    axes: tuple[MeshAxis, ...],
    mesh: MeshSpec,
    options: PlannerOptions,
    pins: Pins,
) -> Candidate:
    """The sharding and levers for `mesh` (see the module docstring).

    Args:
        graph: The model's axis graph.
        axes: Mesh axes of size > 1.
        mesh: The mesh.
        options: Budget, profile and job.
        pins: Choices fixed by user rules.

    Returns:
        The chosen `Candidate`.

    Raises:
        NoFit: When a budget is set and no option fits it.
        InfeasibleError: When the rules cannot hold at all.
    """
    choices = remat_options(graph, options.job)
    fitting: list[Candidate] = []
    searched = options
    if options.memory_budget_bytes is not None:
        searched = dataclasses.replace(
            options,
            memory_budget_bytes=usable_budget(options.memory_budget_bytes),
        )
    for remat in choices:
        try:
            assignment = search(graph, axes, searched, pins, frozenset(remat))
        except InfeasibleError:
            if options.memory_budget_bytes is None:
                raise
            continue
        candidate = _candidate(graph, axes, mesh, options, assignment, remat)
        if not _fits(candidate):
            continue
        candidate = _fewest_layers(graph, axes, mesh, options, candidate, choices)
        if options.hardware is None:
            return candidate
        fitting.append(candidate)
    if fitting:
        return min(fitting, key=lambda c: c.estimate.step_time_s or 0.0)
    peak_options = dataclasses.replace(
        options, memory_budget_bytes=None, minimize_peak=True
    )
    remat = choices[-1]
    assignment = search(graph, axes, peak_options, pins, frozenset(remat))
    best = _candidate(graph, axes, mesh, options, assignment, remat)
    if _fits(best):
        return _fewest_layers(graph, axes, mesh, options, best, choices)
    raise NoFit(best, _suggestions(graph, mesh, best.estimate))


def _fits(candidate: Candidate) -> bool:
    """Whether the estimate leaves the headroom under the budget."""
    budget = candidate.estimate.budget_bytes
    return budget is None or candidate.estimate.peak_bytes <= usable_budget(budget)


def _candidate(graph, axes, mesh, options, assignment, remat) -> Candidate:
    chosen = frozenset(remat)
    cost = evaluate(graph, axes, assignment, options)
    memory = estimate_memory(
        graph,
        axes,
        assignment,
        options.optimizer_slots,
        job=options.job,
        half_as_single=options.platform == "cpu",
        remat=chosen,
    )
    flops, recomputed = compute_flops_per_device(graph, axes, assignment, chosen)
    profile = options.hardware
    by_axis = dict(cost.communication_by_axis)
    estimate = dataclasses.replace(
        memory,
        communication_by_axis=by_axis,
        budget_bytes=options.memory_budget_bytes,
        hardware=None if profile is None else profile.name,
        compute_flops=flops,
        recompute_flops=recomputed,
        step_time_s=None
        if profile is None
        else step_time_s(profile, flops, by_axis, mesh.axis_names, mesh.shape),
        levers=_describe_levers(remat),
    )
    return Candidate(assignment, tuple(remat), cost, estimate)


def _fewest_layers(graph, axes, mesh, options, candidate, choices) -> Candidate:
    """Rematerialize as few layers of the last family as still fit."""
    if not candidate.remat:
        return candidate
    position = choices.index(candidate.remat)
    kept_families = choices[position - 1]
    family = candidate.remat[len(kept_families) :]
    low, high = 0, len(family)  # high layers fit; find the fewest
    best = candidate
    while low < high:
        middle = (low + high) // 2
        trial = _candidate(
            graph,
            axes,
            mesh,
            options,
            candidate.assignment,
            kept_families + family[:middle],
        )
        if not _fits(trial):
            low = middle + 1
        else:
            high, best = middle, trial
    return best


def _describe_levers(remat: tuple[str, ...]) -> tuple[str, ...]:
    if not remat:
        return ()
    shown = ", ".join(remat[:3]) + (f", … {remat[-1]}" if len(remat) > 3 else "")
    return (
        f"rematerialize {len(remat)} layer call(s) in the backward pass "
        f"(jax.checkpoint, nothing saved inside): {shown}",
    )


def _suggestions(graph, mesh: MeshSpec, estimate: PlanEstimate) -> list[str]:
    """Changes that would fit the budget, from the least-peak estimate."""
    budget = usable_budget(estimate.budget_bytes or 0)
    state = estimate.parameter_bytes + estimate.gradient_bytes
    state += estimate.optimizer_bytes
    per_batch = estimate.activation_bytes + estimate.data_bytes
    per_batch += estimate.transient_bytes
    suggestions = []
    devices = mesh.device_count
    needed = devices * estimate.peak_bytes / max(budget, 1)
    suggestions.append(
        f"about {2 ** math.ceil(math.log2(max(needed, devices + 1)))} devices "
        f"instead of {devices} (state and batch cut further)"
    )
    if state < budget and per_batch > 0:
        steps = max(2, math.ceil(per_batch / (budget - state)))
        suggestions.append(
            f"a batch {steps}x smaller per step, or gradient accumulation "
            f"over {steps} steps (`gradient_accumulation_steps={steps}` on "
            f"the optimizer, each step fed 1/{steps} of the batch)"
        )
    else:
        suggestions.append(
            f"the model's state alone ({format_bytes(state)} per device) "
            "exceeds the budget: only more devices (or a smaller optimizer "
            "state) help"
        )
    return suggestions
