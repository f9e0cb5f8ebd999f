"""The gradients' reduction over the batch: what XLA combines and holds."""

from __future__ import annotations

from keras_autoshard.graph.axis_graph import AxisGraph, TensorNode
from keras_autoshard.planner.batch_classes import batch_carrying_classes
from keras_autoshard.planner.cost_model import Assignment, local_bytes
from keras_autoshard.planner.remat import gathered_param_terms

# XLA combines the gradients' reductions over the batch into collectives of
# up to this many bytes (`kDefaultAllReduceCombineThreshold` and its
# reduce-scatter twin, `xla/service/collective_utils.h`); a combined one's
# concatenated operand and its result are live at once.
COMBINE_THRESHOLD_BYTES = 30 * 2**20


def reduce_scattered(
    tensor: TensorNode, assignment: Assignment, batch_axes: set[str]
) -> bool:
    """Whether a parameter's gradient is reduce-scattered over the batch's
    axes rather than all-reduced whole: its storage is cut over one of them
    (FSDP), so each device keeps its shard of the sum.

    Args:
        tensor: The parameter's `TensorNode`.
        assignment: The candidate sharding.
        batch_axes: Mesh axis names the batch is cut over.

    Returns:
        True where the gradient is reduce-scattered.
    """
    stored = {axis for _, axis in assignment.fsdp.get(tensor.name, ())}
    return bool(stored & batch_axes)


def reduced_partials(
    graph: AxisGraph, assignment: Assignment, sizes: dict[str, int]
) -> tuple[float, float]:
    """(partials, gradients): bytes per device of the partial parameter
    gradients that the batch's axes all-reduce whole (XLA:CPU one per use of
    a parameter, `AxisGraph.for_platform`), and of the gradients they sum to.
    A parameter stored cut over the batch's axis (FSDP) is reduce-scattered
    instead and not counted.

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding.
        sizes: Mesh axis name -> size.

    Returns:
        The two byte counts.
    """
    batch_axes = {
        assignment.class_axis.get(c) for c in batch_carrying_classes(graph)
    } - {None}
    partials = 0.0
    summed: dict[int, float] = {}
    for event in graph.comm_events:
        tensor = graph.tensors[event.tensor]
        if event.phase != "backward" or tensor.kind != "param":
            continue
        axes = {assignment.class_axis.get(c) for c in event.classes}
        if not axes & batch_axes or reduce_scattered(tensor, assignment, batch_axes):
            continue
        size = local_bytes(tensor, assignment, sizes) * event.multiplicity
        partials += size
        summed[tensor.id] = size
    return partials, sum(summed.values())


def gathered_weight_bytes(
    graph: AxisGraph,
    assignment: Assignment,
    sizes: dict[str, int],
    remat: frozenset[str] = frozenset(),
) -> float:
    """The most one weight stored cut for storage (FSDP) adds while its
    layer runs on XLA:CPU: its gathered copy and its whole gradient before
    the reduce-scatter, each less the stored shard (a copy the backward pass
    keeps anyway, `remat.gathered_param_terms`, counted once). Measured: a
    1024x1024 float32 kernel stored cut 8 ways, the batch cut over the same
    axis, compiled with 8.48 MB of temporaries (the 4 MiB gathered kernel
    beside its 4 MiB gradient) where the estimate without this counted
    none.

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding.
        sizes: Mesh axis name -> size.
        remat: Names of the rematerialized layer calls.

    Returns:
        Bytes per device.
    """
    most = 0.0
    for tensor, copies in gathered_weight_copies(graph, remat):
        if tensor.name not in assignment.fsdp:
            continue
        whole = local_bytes(tensor, assignment, sizes, include_fsdp=False)
        most = max(most, copies * (whole - local_bytes(tensor, assignment, sizes)))
    return most


def gathered_weight_copies(graph: AxisGraph, remat: frozenset[str]):
    """`(parameter, copies)` for every parameter a step reads: stored cut
    for storage, it adds its gathered copy and its whole gradient while its
    layer's gradient is formed (2 copies), or only the gradient where the
    backward pass keeps the gathered copy anyway (1,
    `remat.gathered_param_terms`). `gathered_weight_bytes` and the search's
    budget row (`peak_budget`) count the same copies."""
    unread = set(graph.unread)
    kept = dict(gathered_param_terms(graph, remat))
    return [
        (tensor, 2.0 - min(1.0, kept.get(tensor.id, 0.0)))
        for tensor in graph.params()
        if tensor.id not in unread
    ]
