"""Which axis classes carry the batch, and which a plan may cut."""

from __future__ import annotations

from keras_autoshard.graph.axis_graph import AxisGraph


def input_batch_classes(graph: AxisGraph) -> set[int]:
    """Classes of the inputs' leading (batch) dimension."""
    return {
        t.dim_classes[0]
        for t in graph.tensors
        if t.kind == "input" and t.dim_classes and t.dim_classes[0] is not None
    }


def batch_carrying_classes(graph: AxisGraph) -> set[int]:
    """Classes that carry the batch: the inputs' leading dims and every class
    linked to one by a reshape merge or split, slice or repeat (`b·s` tokens
    flattened for a router, the batch split back out of them).

    Args:
        graph: The model's axis graph.

    Returns:
        Class ids a data axis may cut.
    """
    carrying = set(input_batch_classes(graph))
    grew = True
    while grew:
        grew = False
        for edge in graph.slice_edges:
            ends = {edge.source, edge.target}
            if ends & carrying and not ends <= carrying:
                carrying |= ends
                grew = True
    return carrying


def eligible_classes(graph: AxisGraph) -> set[int]:
    """Classes a plan can cut: those of parameters (their layouts carry the
    cut into the program) and every class that carries the batch (the data
    layout does). A class with no variable stays whole, and a slice edge
    into it keeps its source whole too: a batch class left out (the
    `b·windows` dim between two reshapes that no contraction names) would
    keep the whole batch from being split. Classes those reach through
    slice edges are offered too. A class of activations alone (a sequence)
    is not offered: nothing in the applied plan lays it out, so
    XLA computes it whole on every device (measured: a 6-block MLP planned
    with its sequence on 'model' compiled to 6x the estimated peak)."""
    eligible = set(batch_carrying_classes(graph))
    for tensor in graph.tensors:
        if tensor.kind == "param":
            eligible.update(c for c in tensor.dim_classes if c is not None)
    # A class a cut one reaches through a reshape split or a slice (the
    # heads of a projection's output) takes that cut in the program too.
    grown = True
    while grown:
        reached = {e.target for e in graph.slice_edges if e.source in eligible}
        grown = not reached <= eligible
        eligible |= reached
    return eligible
