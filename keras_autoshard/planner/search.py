"""Find the cheapest `Assignment`: the attempts `search` makes.

Each attempt solves the exact program `milp_builder.py` builds (a
`MilpProgram`): the batch split forced over the data axes, else preferred,
with identical blocks tied, else free; on the mesh's own axes first, then
with an axis spanning them where a grouped convolution keeps the batch
whole; then, where no axis cuts the batch at all (a mesh with no data axis
of size > 1), with model axes free to cut it, the least replicated compute
first.
"""

from __future__ import annotations

import dataclasses
import logging

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.batch_classes import (
    input_batch_classes as batch_input_classes,
)
from keras_autoshard.planner.cost_model import Assignment, PlannerOptions
from keras_autoshard.planner.linear_program import InfeasibleError
from keras_autoshard.planner.mesh_axis import MeshAxis, mesh_axes
from keras_autoshard.planner.milp_builder import solve_program
from keras_autoshard.planner.pins import Pins

logger = logging.getLogger(__name__)


def search(
    graph: AxisGraph,
    axes: tuple[MeshAxis, ...],
    options: PlannerOptions,
    pins: Pins | None = None,
    remat: frozenset[str] = frozenset(),
    micro_batches: int = 1,
) -> Assignment:
    """The `Assignment` of least cost whose peak fits the memory budget.

    Args:
        graph: The model's axis graph.
        axes: Mesh axes of size > 1.
        options: Budget and cost knobs.
        pins: Choices fixed by user rules.
        remat: Names of the layer calls rematerialized (`graph/blocks.py`) (what the
            budget counts as kept for the backward pass).
        micro_batches: Gradient accumulation parts the budget counts with.

    Returns:
        The optimal `Assignment` (raises `InfeasibleError` if none fits).
        Every input's batch dim is split over the data axes when that can
        hold; where it cannot on the mesh's own axes (a grouped convolution
        whose channels the other axes cannot take), over an axis spanning
        all of them (`MeshAxis.spanning`) when that holds. Where no axis
        cuts it at all (no data axis of size > 1, or an op that mixes the
        batch with other dims, or a batch that does not divide), the model
        axes may take it too (`options.batch_over_model_axes`, unless
        sequence parallelism is asked for), and the plan repeats the fewest
        matrix products first, then moves the fewest bytes; it may still
        leave the batch whole.
    """
    own = mesh_axes(axes)
    found = _search_attempts(graph, own, options, pins, remat, micro_batches)
    if own != axes and not _splits_batch(graph, own, found):
        try:
            wider = _search_attempts(graph, axes, options, pins, remat, micro_batches)
        except InfeasibleError:
            wider = None
        if wider is not None and _splits_batch(graph, axes, wider):
            found = wider
    if (
        _cuts_batch(graph, found)
        or micro_batches > 1
        or not options.batch_over_model_axes
        # Sequence parallelism asked for needs the axis for the model.
        or options.sequence_parallel is True
    ):
        return found
    carriers = _batch_over_model_axes(own)
    if carriers == own:
        return found
    try:
        return _search_attempts(
            graph, carriers, options, pins, remat, micro_batches, compute_first=True
        )
    except InfeasibleError:
        return found


def _cuts_batch(graph, assignment: Assignment) -> bool:
    """Whether some input's batch is cut over some axis."""
    return any(cls in assignment.class_axis for cls in batch_input_classes(graph))


def _batch_over_model_axes(axes: tuple[MeshAxis, ...]) -> tuple[MeshAxis, ...]:
    """`axes` with every model axis free to carry the batch too: where no
    data axis cuts it, the objective chooses between cutting the model over
    such an axis and cutting the batch (data parallelism: a gradient
    all-reduce against compute every device repeats)."""
    return tuple(dataclasses.replace(a, model_only=False) for a in axes)


def _splits_batch(graph, axes, assignment: Assignment) -> bool:
    """Whether every input's batch is cut over every data axis of `axes`."""
    covers = {a.name: a.covers for a in axes}
    data = [a.name for a in axes if a.data_only]
    for cls in batch_input_classes(graph):
        cut = covers.get(assignment.class_axis.get(cls), ())
        if any(name not in cut for name in data):
            return False
    return True


def _search_attempts(
    graph, axes, options, pins, remat, micro_batches, compute_first=False
) -> Assignment:
    """`_solve` with the batch split forced, else preferred, with identical
    blocks tied, else free."""
    attempts = [("forced", True), ("preferred", True), ("preferred", False)]
    for position, (batch_split, symmetric) in enumerate(attempts):
        try:
            return solve_program(
                graph,
                axes,
                options,
                pins or Pins(),
                batch_split,
                symmetric,
                remat,
                micro_batches,
                compute_first,
            )
        except InfeasibleError as error:
            if position == len(attempts) - 1:
                raise
            logger.info(
                "No plan with batch split %s and symmetric blocks %s (%s).",
                batch_split,
                symmetric,
                error,
            )
    raise AssertionError("unreachable")
