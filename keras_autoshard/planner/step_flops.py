"""The compute of one training step on one device, under a candidate
sharding: what the step time is estimated from (`plans.hardware.step_time_s`)."""

from __future__ import annotations

import math

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.cost_model import (
    Assignment,
    contraction_flops,
    iteration_classes,
)
from keras_autoshard.planner.mesh_axis import MeshAxis


def compute_flops_per_device(
    graph: AxisGraph,
    axes: tuple[MeshAxis, ...],
    assignment: Assignment,
    remat: frozenset[str] = frozenset(),
) -> tuple[float, float]:
    """FLOPs of one training step's contractions on one device: each forward
    contraction split by the mesh axes that cut its work, times three
    (forward, and the two products of its backward pass), and once more
    where a rematerialized layer recomputes it.

    Args:
        graph: The model's axis graph.
        axes: Mesh axes of size > 1.
        assignment: The candidate sharding.
        remat: Names of the layer calls rematerialized (`graph/blocks.py`).

    Returns:
        `(total FLOPs, of which recomputation)`.
    """
    sizes = {a.name: a.size for a in axes}
    total = recomputed = 0.0
    for event in graph.comm_events:
        if event.kind != "contract" or event.phase != "forward":
            continue
        used = {assignment.class_axis.get(c) for c in iteration_classes(graph, event)}
        ways = math.prod(sizes[a] for a in used if a is not None)
        flops = contraction_flops(graph, event) / ways
        total += 3.0 * flops
        if graph.tensor_layers and graph.tensor_layers[event.tensor] in remat:
            recomputed += flops
    return total + recomputed, recomputed
