"""Where XLA's partitioner carries a parameter's storage cut into the
activations: the residual stream held cut over an axis the plan computes
it whole on (`held_as_partitioned`, read by `memory_model.accelerator_peak`;
`stream_drift` also by `output_layouts`).
"""

from __future__ import annotations

import dataclasses

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.batch_classes import batch_carrying_classes
from keras_autoshard.planner.cost_model import Assignment, tensor_axes


def stream_drift(graph: AxisGraph, assignment: Assignment) -> StreamDrift:
    """The storage cuts that XLA's partitioner carries into the activations.

    A one-dimensional parameter read only elementwise (a norm's scale, a
    bias) and stored cut over a mesh axis on a dim its class's activations
    do not cut (an FSDP-style storage cut) is not gathered: the partitioner
    cuts the activations it multiplies or adds over that axis instead, and
    with them the residual stream between layers. A table read by a gather
    is gathered instead, and so is a kernel read by a matrix product,
    unless it is stored cut over an axis that cuts no token dim
    (`kernel_drift`, which `held_as_partitioned` adds; kept out of
    `sources`, so the plan's output pins do not change with it).

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding.

    Returns:
        A `StreamDrift`: each such class with its axis, and the parameters
        that carry their cut into it.
    """
    classes: dict[int, str] = {}
    sources: set[str] = set()
    unread = set(graph.unread)
    for tensor in graph.tensors:
        if tensor.kind != "param" or len(tensor.shape) != 1:
            continue  # a table, a kernel: `kernel_drift`
        if tensor.id in graph.matmul_operand_ids or tensor.id in unread:
            continue  # nothing elementwise to propagate from
        for dim, axis in assignment.fsdp.get(tensor.name, ()):
            cls = tensor.dim_classes[dim]
            if cls is None or assignment.class_axis.get(cls) is not None:
                continue
            classes.setdefault(cls, axis)
            sources.add(tensor.name)
    return StreamDrift(classes, frozenset(sources))


@dataclasses.dataclass(frozen=True)
class StreamDrift:
    """Storage cuts the partitioner carries into the activations.

    Attributes:
        classes: Axis class → the mesh axis its activations between layers
            are held cut over.
        sources: Names of the one-dimensional parameters whose storage cut
            does it (the plan pins no output of their layers:
            `planner/output_layouts.py`).
    """

    classes: dict[int, str]
    sources: frozenset[str]


def kernel_drift(graph: AxisGraph, assignment: Assignment) -> dict[int, str]:
    """Classes whose activations XLA's partitioner holds cut because a
    kernel is stored cut on them.

    A parameter of two or more dims stored cut over a mesh axis on a dim
    whose class the plan computes whole, where that axis cuts no token dim,
    is not gathered: the partitioner cuts the activations it is multiplied
    with over that axis instead, and with them the residual stream. Read off
    XLA:GPU's program of a Llama at Llama-2-70B widths on 16x16 whose key
    and value kernels (8 heads, not cut 16 ways) are stored cut over
    `model` on their hidden dim: each layer's compiled peak grows by
    0.21 GiB, its checkpointed input held a sixteenth as large; counted
    whole, the estimate grew by 0.67 GiB per layer (estimate over compiled
    2.15 at 80 layers), with this rule by 0.21 GiB. A kernel stored cut over
    the axis that carries the tokens (FSDP over the data axis) is gathered
    instead: its cut stays out of the stream (Llama-2-70B on 32x8); so is
    a table read by a gather.

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding.

    Returns:
        Axis class → the mesh axis its activations are held cut over.
    """
    token_axes = {
        assignment.class_axis.get(c) for c in batch_carrying_classes(graph)
    } - {None}
    # A table read by a gather (or its cast, under mixed precision) is
    # gathered where it is read.
    looked_up = {
        (graph.tensors[e.tensor].shape, graph.tensors[e.tensor].dim_classes)
        for e in graph.comm_events
        if "gather" in e.primitive.split("+")
    }
    classes: dict[int, str] = {}
    for tensor in graph.tensors:
        if tensor.kind != "param" or len(tensor.shape) < 2:
            continue
        if (tensor.shape, tensor.dim_classes) in looked_up:
            continue
        for dim, axis in assignment.fsdp.get(tensor.name, ()):
            cls = tensor.dim_classes[dim]
            if cls is None or axis in token_axes:
                continue
            if assignment.class_axis.get(cls) is None:
                classes.setdefault(cls, axis)
    return classes


def held_as_partitioned(graph: AxisGraph, assignment: Assignment) -> Assignment:
    """The sharding XLA's partitioner gives the activations once it has
    propagated the storage cuts it does not gather (`stream_drift`,
    `kernel_drift`).

    The residual stream between layers (the activations a layer reads from
    outside its call, what a rematerialized call keeps) is cut over the
    drifted axis; inside a layer the activations keep the plan's cuts. Read
    off XLA:GPU's program of a Llama at Llama-2-70B widths on 16x16 whose
    feed-forward norm scale is stored cut over `model`: the row-parallel
    outputs are reduce-scattered over `model` on the hidden dim, and each
    layer's checkpointed input is held a sixteenth as large. A table read by
    a gather (an embedding cut over `model` on its hidden dim, Llama-2-70B
    on 32x8) moves nothing: its compiled layers' inputs are held whole.
    A kernel stored cut on a dim the plan computes whole, over an axis that
    cuts no token dim, carries its cut too (`kernel_drift`).

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding.

    Returns:
        `assignment` with those activations' cuts added.
    """
    drifted = {
        **kernel_drift(graph, assignment),
        **stream_drift(graph, assignment).classes,
    }
    if not drifted:
        return assignment
    cuts = dict(assignment.activation_cuts)
    between_layers = {t for _, ids in graph.layer_inputs for t in ids}
    for tensor in graph.tensors:
        if tensor.id not in between_layers:
            continue
        used = set(tensor_axes(tensor, assignment))
        added = []
        for dim, cls in enumerate(tensor.dim_classes):
            axis = drifted.get(cls)
            if axis is not None and axis not in used:
                added.append((dim, axis))
                used.add(axis)
        if added:
            cuts[tensor.id] = tuple(cuts.get(tensor.id, ())) + tuple(added)
    return dataclasses.replace(assignment, activation_cuts=cuts)
