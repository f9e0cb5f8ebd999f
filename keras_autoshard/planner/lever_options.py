"""The options each memory lever offers, in the order the planner tries
them (`levers.choose_levers`): rematerialization (none, then families of
repeated layers), sequence parallelism and gradient accumulation's
micro-batch counts, each checked against what the user asked for.
"""

from __future__ import annotations

import math

from keras_autoshard.errors import PlanError
from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.mesh_axis import MeshAxis
from keras_autoshard.planner.remat import layer_calls, remat_families

REMAT_REQUESTS = ("auto", "none", "all")


def remat_options(graph: AxisGraph, job: str, request="auto") -> list[tuple[str, ...]]:
    """Rematerialization options in order of recomputation.

    Args:
        graph: The model's axis graph.
        job: `"train"`, `"inference"` or `"generate"` (nothing to rematerialize).
        request: `"auto"` (every option, the planner chooses), `"none"`,
            `"all"` (every repeated-layer family) or layer names.

    Returns:
        Tuples of layer names: none first, then each family added (one
        option only for a request other than `"auto"`).

    Raises:
        PlanError: When a requested layer is not a unit of the model
            (`graph/blocks.py`), or `"all"` finds no family to rematerialize.
    """
    options: list[tuple[str, ...]] = [()]
    if job != "train" or request == "none":
        return options
    for family in remat_families(graph):
        options.append(options[-1] + family)
    if request == "auto":
        return options
    if request == "all":
        if len(options) == 1:
            units = layer_calls(graph)
            raise PlanError(
                "rematerialize='all' asks for every family of repeated layers, "
                "and this model has none whose rematerialization frees memory "
                f"(its layer calls: {units[:12]}{' …' if len(units) > 12 else ''}). "
                "Name the layers to rematerialize instead, or plan without it."
            )
        return [options[-1]]
    return [_requested_layers(graph, request)]


def _requested_layers(graph: AxisGraph, request) -> tuple[str, ...]:
    if isinstance(request, str):
        raise PlanError(
            f"rematerialize={request!r}: use one of {REMAT_REQUESTS} or a "
            "list of layer names (as the plan's `rematerialize` lists them)."
        )
    layers = layer_calls(graph)
    missing = sorted(set(request) - set(layers))
    if missing:
        raise PlanError(
            f"rematerialize names {missing}, which are not layer calls the "
            f"planner can rematerialize; the model's are {layers[:12]}"
            f"{' …' if len(layers) > 12 else ''}."
        )
    return tuple(layer for layer in layers if layer in set(request))


SEQUENCE_PARALLEL_REQUESTS = (False, True, "auto")


def sequence_parallel_modes(request, job: str) -> tuple[bool, ...]:
    """Sequence-parallel options to try, in order.

    Args:
        request: `False`, `True`, or `"auto"` (only where the plan without it
            does not fit: tried before each rematerialization option, as it
            recomputes nothing).
        job: `"train"`, `"inference"` or `"generate"`.

    Returns:
        `(False,)`, `(True,)` or `(False, True)`.

    Raises:
        ValueError: For another request.
    """
    if request not in SEQUENCE_PARALLEL_REQUESTS or request is None:
        raise ValueError(
            f"sequence_parallel={request!r}: use one of {SEQUENCE_PARALLEL_REQUESTS}."
        )
    if request == "auto":
        return (False, True)
    return (bool(request),)


def accumulation_options(
    graph: AxisGraph, axes: tuple[MeshAxis, ...], job: str
) -> list[int]:
    """Micro-batch counts to try: powers of two dividing each device's
    batch (the inputs' leading dim over the data axes).

    Args:
        graph: The model's axis graph.
        axes: Mesh axes of size > 1.
        job: `"train"`, `"inference"` or `"generate"` (no accumulation).

    Returns:
        Counts in increasing order (empty when the batch cannot be split).
    """
    if job != "train":
        return []
    per_device = rows_per_data_rank(graph, axes)
    counts, parts = [], 2
    while parts <= per_device:
        if per_device % parts == 0:
            counts.append(parts)
        parts *= 2
    return counts


def rows_per_data_rank(graph: AxisGraph, axes: tuple[MeshAxis, ...]) -> int:
    """The batch one data-parallel rank feeds a step (the inputs' leading
    dim over the data axes; 1 without inputs)."""
    inputs = [t for t in graph.tensors if t.kind == "input" and t.shape]
    if not inputs:
        return 1
    return inputs[0].shape[0] // math.prod(a.size for a in axes if a.data_only)
