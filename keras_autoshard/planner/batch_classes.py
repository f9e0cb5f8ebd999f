"""Which axis classes carry the batch."""

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
