"""Memory levers chosen together with the sharding.

For one mesh, the planner tries each rematerialization option
(`lever_options.remat_options`: none, then the repeated-layer families of
`remat.remat_families` added one at a time, largest saving first), each
without and then, when `sequence_parallel="auto"`, with sequence
parallelism (`sequence_parallel.py`: it recomputes nothing, so it comes
before the next rematerialization option). Each
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
from typing import Literal

from keras_autoshard.errors import PlanError
from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.cost_model import (
    Assignment,
    PlanCost,
    PlannerOptions,
    evaluate,
)
from keras_autoshard.planner.lever_options import (
    accumulation_options,
    remat_options,
    rows_per_data_rank,
    sequence_parallel_modes,
)
from keras_autoshard.planner.linear_program import InfeasibleError
from keras_autoshard.planner.memory_model import estimate_memory
from keras_autoshard.planner.mesh_axis import MeshAxis
from keras_autoshard.planner.notes import (
    accumulation_description,
    fit_suggestions,
    lever_text,
    remat_description,
)
from keras_autoshard.planner.pins import Pins
from keras_autoshard.planner.search import search
from keras_autoshard.planner.sequence_parallel import (
    SequenceCut,
    sequence_cut,
    with_sequence_cut,
)
from keras_autoshard.planner.sequence_parallel import describe as describe_sequence
from keras_autoshard.planner.step_flops import compute_flops_per_device
from keras_autoshard.plans.estimate import (
    COMPILERS,
    PlanEstimate,
    usable_budget,
    xla_gpu_program_limit,
)
from keras_autoshard.plans.hardware import step_time_s
from keras_autoshard.plans.mesh import MeshSpec
from keras_autoshard.plans.units import format_bytes
from keras_autoshard.runtime.gpu_targets import device_memory_size

LeverKind = Literal["rematerialize", "accumulate", "sequence_parallel"]


@dataclasses.dataclass(frozen=True)
class Lever:
    """One memory lever of a plan, beside its sharding.

    Args:
        kind: `"rematerialize"` (layer calls recomputed in the backward
            pass), `"accumulate"` (gradient accumulation over micro-batches)
            or `"sequence_parallel"` (the token dim cut between
            tensor-parallel regions).
        description: What it does, in words (`notes.lever_text` adds why).
        asked: Whether the user asked for it, rather than the planner
            choosing it to fit the budget.

    Example:
        `Lever("accumulate", "gradient accumulation over 2 micro-batches", False)`
    """

    kind: LeverKind
    description: str
    asked: bool = False


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One mesh's plan: its sharding, levers and estimate.

    Args:
        assignment: The sharding.
        remat: Names of the rematerialized layers, in call order.
        cost: Its communication and state bytes (`cost_model.evaluate`).
        estimate: The full per-device estimate, levers listed.
        micro_batches: Gradient accumulation parts (1: none).
        sequence: The sequence-parallel cut, already in `assignment`
            (`None`: not asked for).
        levers: Its levers (`estimate.levers` holds their text).
    """

    assignment: Assignment
    remat: tuple[str, ...]
    cost: PlanCost
    estimate: PlanEstimate
    micro_batches: int = 1
    sequence: SequenceCut | None = None
    levers: tuple[Lever, ...] = ()


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
        estimate = self.best.estimate
        return estimate.peak_bytes - (estimate.usable_bytes or 0)


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
    choices = remat_options(graph, options.job, options.rematerialize)
    # Trim rematerialization to the fewest layers only when it was chosen.
    trim = options.rematerialize == "auto"
    sequence_modes = sequence_parallel_modes(options.sequence_parallel, options.job)
    searched = options
    if options.memory_budget_bytes is not None:
        searched = dataclasses.replace(
            options,
            memory_budget_bytes=usable_budget(
                options.memory_budget_bytes, COMPILERS[options.platform]
            ),
        )

    def attempt(remat, sequence, micro_batches=1) -> Candidate | None:
        try:
            assignment = search(
                graph, axes, searched, pins, frozenset(remat), micro_batches
            )
        except InfeasibleError:
            if options.memory_budget_bytes is None:
                raise
            if not sequence:
                return None
            # The search's budget knows nothing of sequence parallelism:
            # cut the tokens of the least-communication sharding instead.
            unbounded = dataclasses.replace(searched, memory_budget_bytes=None)
            assignment = search(
                graph, axes, unbounded, pins, frozenset(remat), micro_batches
            )
        candidate = _candidate(
            graph, axes, mesh, options, assignment, remat, micro_batches, sequence
        )
        if not _fits(candidate):
            return None
        if not trim:
            return candidate
        return _fewest_layers(graph, axes, mesh, options, candidate, choices)

    asked_steps = options.gradient_accumulation_steps
    if asked_steps is not None and asked_steps > 1:
        return _asked_accumulation(
            graph, axes, mesh, options, pins, attempt, choices, sequence_modes
        )
    fitting: list[Candidate] = []
    for remat in choices:
        for sequence in sequence_modes:
            candidate = attempt(remat, sequence)
            if candidate is None:
                continue
            if options.hardware is None:
                return candidate
            fitting.append(candidate)
    if fitting:
        return min(fitting, key=lambda c: c.estimate.step_time_s or 0.0)
    peak_options = dataclasses.replace(
        options, memory_budget_bytes=None, minimize_peak=True
    )
    assignment = search(graph, axes, peak_options, pins, frozenset(choices[-1]))
    best = _candidate(
        graph, axes, mesh, options, assignment, choices[-1], 1, sequence_modes[-1]
    )
    if _fits(best):
        if not trim:
            return best
        return _fewest_layers(graph, axes, mesh, options, best, choices)
    # Only when nothing else fits: gradient accumulation over micro-batches
    # (unless asked for none).
    counts = accumulation_options(graph, axes, options.job)
    for micro_batches in counts if asked_steps is None else ():
        candidate = attempt(choices[-1], sequence_modes[-1], micro_batches)
        if candidate is not None:
            return candidate
    raise NoFit(best, fit_suggestions(mesh, best.estimate))


def _asked_accumulation(
    graph, axes, mesh, options, pins, attempt, choices, sequence_modes
) -> Candidate:
    """The levers with the micro-batches asked for: the first
    rematerialization and sequence option that fits, else the one that
    needs the least memory (a `NoFit` when a budget was set)."""
    steps = options.gradient_accumulation_steps
    rows = rows_per_data_rank(graph, axes)
    if options.job != "train" or rows % steps:
        raise PlanError(
            f"gradient_accumulation_steps={steps}: a training step's batch per "
            f"data-parallel rank ({rows} rows) must be a multiple of it."
        )
    for remat in choices:
        for sequence in sequence_modes:
            candidate = attempt(remat, sequence, steps)
            if candidate is not None:
                return candidate
    unbounded = dataclasses.replace(options, memory_budget_bytes=None)
    assignment = search(graph, axes, unbounded, pins, frozenset(choices[-1]), steps)
    best = _candidate(
        graph, axes, mesh, options, assignment, choices[-1], steps, sequence_modes[-1]
    )
    # The search's budget row is an envelope of the step's phases, above the
    # estimate: it may refuse a plan whose estimate fits, which is kept.
    if options.memory_budget_bytes is None or _fits(best):
        return best
    raise NoFit(best, fit_suggestions(mesh, best.estimate))


def _fits(candidate: Candidate) -> bool:
    """Whether the estimate leaves the headroom under the budget."""
    return candidate.estimate.fits is not False


def _candidate(
    graph,
    axes,
    mesh,
    options,
    assignment,
    remat,
    micro_batches=1,
    sequence_parallel=False,
) -> Candidate:
    chosen = frozenset(remat)
    sequence = None
    held = assignment
    if sequence_parallel:
        assignment = dataclasses.replace(assignment, activation_cuts={})
        sequence = sequence_cut(graph, axes, assignment)
        held = with_sequence_cut(assignment, sequence, held=True)
        assignment = with_sequence_cut(assignment, sequence)
    cost = evaluate(graph, axes, assignment, options)
    memory = estimate_memory(
        graph,
        axes,
        held,
        options.optimizer_slots,
        job=options.job,
        half_as_single=options.platform == "cpu",
        remat=chosen,
        micro_batches=micro_batches,
        platform=options.platform,
    )
    flops, recomputed = compute_flops_per_device(graph, axes, assignment, chosen)
    levers = _memory_levers(
        remat,
        micro_batches,
        asked=options.rematerialize != "auto",
        asked_micro_batches=options.gradient_accumulation_steps is not None,
    ) + _sequence_levers(sequence, axes, asked=options.sequence_parallel is True)
    profile = options.hardware
    # Per step of the whole batch: every micro-batch reduces the gradients
    # over the data axes again.
    by_axis = {
        axis: moved * (micro_batches if axis in _data_axes(axes) else 1)
        for axis, moved in cost.communication_by_axis.items()
    }
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
        levers=tuple(lever_text(lever) for lever in levers),
        search=None if assignment.search is None else assignment.search.describe(),
    )
    estimate = dataclasses.replace(
        estimate, compiler_limit_bytes=_compiler_limit(estimate, profile)
    )
    return Candidate(
        assignment, tuple(remat), cost, estimate, micro_batches, sequence, levers
    )


def _compiler_limit(estimate: PlanEstimate, profile) -> int | None:
    """XLA:GPU's own limit on a training step planned for a GPU profile
    that has a target description (`xla_gpu_program_limit`)."""
    if profile is None or estimate.compiler != "XLA:GPU" or estimate.job != "train":
        return None
    memory = device_memory_size(profile)
    if memory is None:
        return None
    return xla_gpu_program_limit(memory, estimate.io_bytes)


def _sequence_levers(
    sequence: SequenceCut | None, axes, asked: bool
) -> tuple[Lever, ...]:
    if sequence is None or not sequence.layers:
        return ()
    size = {a.name: a.size for a in axes}[sequence.axis]
    return (Lever("sequence_parallel", describe_sequence(sequence, size), asked),)


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
            candidate.micro_batches,
            candidate.sequence is not None,
        )
        if not _fits(trial):
            low = middle + 1
        else:
            high, best = middle, trial
    return best


def _data_axes(axes: tuple[MeshAxis, ...]) -> set[str]:
    """Axes whose collectives reduce the batch's gradients (data axes, and
    axes spanning several mesh axes, which cut only the batch)."""
    return {a.name for a in axes if a.data_only or a.members}


def _memory_levers(
    remat: tuple[str, ...],
    micro_batches: int = 1,
    asked: bool = False,
    asked_micro_batches: bool = False,
) -> tuple[Lever, ...]:
    levers = []
    if remat:
        levers.append(Lever("rematerialize", remat_description(remat), asked))
    if micro_batches > 1:
        levers.append(
            Lever(
                "accumulate",
                accumulation_description(micro_batches),
                asked_micro_batches,
            )
        )
    return tuple(levers)
