"""Why a plan is what it is: the reason given for each variable and the
plan's notes (what was kept whole and why, the batch split, the estimate)."""

from __future__ import annotations

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.batch_classes import batch_carrying_classes
from keras_autoshard.planner.cost_model import (
    Assignment,
    PlanCost,
    PlannerOptions,
    contraction_flops,
    repeated_products,
)
from keras_autoshard.planner.mesh_axis import planning_axes
from keras_autoshard.plans.mesh import DATA_AXIS_NAMES, MeshSpec, entry_axes, entry_text
from keras_autoshard.plans.units import format_bytes

# The reason of a variable a user rule pins.
USER_RULE_REASON = "user rule"
# The reason of a variable no floating-point equation of the step reads.
NOT_COMPUTED_REASON = "replicated: not a floating-point tensor of the computation"


def batch_notes(graph: AxisGraph, mesh: MeshSpec, assignment: Assignment) -> list[str]:
    """Why the batch is not split over the mesh's data axes, when it is not,
    or is cut over every mesh axis (`MeshAxis.spanning`).

    Args:
        graph: The model's axis graph.
        mesh: The plan's mesh.
        assignment: The chosen sharding.

    Returns:
        One note per input whose batch dim stays whole on a data axis of
        size > 1, naming the input, its batch size and what kept it whole;
        one per input whose batch is cut over every axis, saying why.
    """
    data_axes = {
        name: size
        for name, size in zip(mesh.axis_names, mesh.shape)
        if name in DATA_AXIS_NAMES and size > 1
    }
    carrying = batch_carrying_classes(graph)
    if not data_axes:
        return _whole_on_every_device(graph, mesh, assignment, carrying)
    notes = []
    for tensor in graph.tensors:
        if tensor.kind != "input" or not tensor.dim_classes:
            continue
        cls_id = tensor.dim_classes[0]
        cut_over = entry_axes(assignment.class_axis.get(cls_id))
        batch = tensor.shape[0] if tensor.shape else 1
        if len(cut_over) > 1:
            why = _batch_kept_whole_because(graph, cls_id, batch, data_axes, carrying)
            notes.append(
                f"Input {tensor.name!r}: its batch ({batch} rows) is cut over "
                f"every mesh axis ({entry_text(cut_over)!r}), since cut over "
                f"{_listed([repr(n) for n in data_axes])} alone it could not be: {why}"
            )
            continue
        if cls_id is not None and set(cut_over) & set(data_axes):
            continue
        axes_text = ", ".join(f"{n!r} (size {s})" for n, s in data_axes.items())
        why = _batch_kept_whole_because(graph, cls_id, batch, data_axes, carrying)
        notes.append(
            f"The batch of input {tensor.name!r} ({batch} rows) is not split over "
            f"{axes_text}: every device of that axis computes the whole batch. "
            f"Why: {why}"
        )
    return notes


def _whole_on_every_device(graph, mesh, assignment, carrying) -> list[str]:
    """On a mesh with no data axis: why an input's batch that no axis cuts
    stays whole (the batch may take a model axis, `search._batch_over_model_axes`)."""
    sizes = {n: s for n, s in zip(mesh.axis_names, mesh.shape) if s > 1}
    if not sizes:
        return []
    notes = []
    for tensor in graph.tensors:
        if tensor.kind != "input" or not tensor.dim_classes:
            continue
        cls_id = tensor.dim_classes[0]
        if assignment.class_axis.get(cls_id) is not None:
            continue
        batch = tensor.shape[0] if tensor.shape else 1
        why = _why_no_axis_cuts(graph, cls_id, batch, sizes, carrying, assignment)
        notes.append(
            f"Input {tensor.name!r}: its batch ({batch} rows) is kept whole on "
            f"every device: {why}"
        )
    return notes


def _unshardable_reasons(graph, classes) -> list[str]:
    """Why any of `classes` may not be cut, each reason once, sorted."""
    return sorted(
        {
            graph.classes[c].unshardable_reason
            for c in classes
            if graph.classes[c].unshardable_reason is not None
        }
    )


def _why_no_axis_cuts(graph, cls_id, batch, sizes, carrying, assignment) -> str:
    if cls_id is None:
        return "the batch has one row."
    if all(batch % s for s in sizes.values()):
        axes = _listed([f"{n!r} (size {s})" for n, s in sizes.items()])
        return (
            f"{batch} rows divide no mesh axis ({axes}); use a batch size "
            f"that is a multiple of {min(sizes.values())}."
        )
    linked = _unshardable_reasons(graph, carrying)
    if linked:
        return _listed(linked) + "."
    reshaped = sorted(
        (graph.classes[c].size, entry_text(assignment.class_axis[c]))
        for c in carrying
        if c != cls_id and assignment.class_axis.get(c) is not None
    )
    if reshaped:
        size, axis = reshaped[-1]
        return (
            f"{axis!r} cuts the {size} rows it is reshaped into instead (the "
            "batch merged with another dimension): every device computes its "
            "part of them."
        )
    used = sorted({a for a in assignment.class_axis.values() if a is not None})
    axes_text = _listed([repr(entry_text(a)) for a in used]) or "no axis"
    return (
        f"the mesh has no data axis, and cutting the model over {axes_text} "
        "repeats no more matrix products on the devices than cutting the "
        "batch would, and moves fewer bytes per step or fits the memory "
        "budget where cutting the batch does not."
    )


def _batch_kept_whole_because(graph, cls_id, batch, data_axes, carrying) -> str:
    if cls_id is None:
        return "the batch has one row."
    not_dividing = [n for n, s in data_axes.items() if batch % s]
    if not_dividing:
        size = data_axes[not_dividing[0]]
        return (
            f"{batch} rows do not divide {not_dividing[0]!r} (size {size}); use a "
            f"batch size that is a multiple of {size}."
        )
    linked = _unshardable_reasons(graph, carrying)
    if linked:
        return _listed(linked) + "."
    convs = [
        conv
        for conv in graph.grouped_convs
        if set(graph.tensors[conv.tensor].dim_classes) & carrying
    ]
    if convs:
        why_whole = sorted({_channels_kept_whole(graph, c, data_axes) for c in convs})
        layers = sorted({repr(conv.layer or "?") for conv in convs})
        return (
            f"grouped convolution in layer {_listed(layers)}: XLA computes its "
            "filter gradient wrong unless every mesh axis cuts its input once "
            "the batch is cut (see keras_autoshard.graph.axis_graph.GroupedConv), "
            f"and its channels cannot take the other axes ({_listed(why_whole)})."
        )
    reasons = sorted(
        {
            edge.reason or "a reshape"
            for edge in graph.slice_edges
            if {edge.source, edge.target} & carrying
        }
    )
    if reasons:
        return (
            "splitting it conflicts with how the batch is reshaped or sliced ("
            + ", ".join(reasons)
            + ") together with the other choices of the plan."
        )
    return "a dimension that carries the batch cannot take the data axis."


def _channels_kept_whole(graph, conv, data_axes) -> str:
    """Why a grouped convolution's channels stay whole."""
    cls_id = graph.tensors[conv.tensor].dim_classes[conv.feature_dim]
    if cls_id is None:
        return "they are one channel"
    cls = graph.classes[cls_id]
    if cls.unshardable_reason is not None:
        return f"{cls.size} channels: {cls.unshardable_reason}"
    return f"{cls.size} channels, with the other choices of the plan"


def _listed(reasons: list[str], shown: int = 4) -> str:
    """The first `shown` reasons, then how many more there are."""
    text = "; ".join(reasons[:shown])
    if len(reasons) > shown:
        text += f"; and {len(reasons) - shown} more like these"
    return text


def variable_reason(tensor, spec, var_roles, assignment, unread=False) -> str:
    parts = []
    fsdp_dims = {d for d, _ in assignment.fsdp.get(tensor.name, ())}
    for dim, axis in enumerate(spec):
        role = var_roles[dim] or "dim"
        if axis is None:
            continue
        how = "FSDP storage" if dim in fsdp_dims else "follows the computation"
        if unread and dim in fsdp_dims:
            how = "stored cut for free (the step never reads it)"
        parts.append(f"{role} (dim {dim}) on {axis!r}: {how}")
    if not parts:
        return "replicated: sharding it would add communication or break no tie"
    return "; ".join(parts)


def expert_notes(graph, sizes, assignment, roles) -> list[str]:
    """How the experts of stacked expert kernels are placed."""
    notes = []
    for cls_id, role in sorted(roles.items()):
        if role != "experts":
            continue
        count = graph.classes[cls_id].size
        axis = assignment.class_axis.get(cls_id)
        if axis is not None:
            notes.append(
                f"Expert parallelism: {count} experts cut over {axis!r} "
                f"({count // sizes[axis]} per device); each device runs its "
                "experts and their weighted outputs are summed over "
                f"{axis!r}."
            )
            continue
        not_dividing = [n for n, s in sizes.items() if s > 1 and count % s]
        why = (
            f"{count} experts do not divide {not_dividing[0]!r} (size "
            f"{sizes[not_dividing[0]]})"
            if not_dividing
            else "cutting them would cost more than the alternatives"
        )
        notes.append(
            f"The {count} experts are kept whole on every device ({why}); "
            "tensor parallelism inside each expert is used where it pays."
        )
    return notes


def slice_edge_notes(graph, assignment, sizes) -> list[str]:
    """One note per kind of dim kept whole while the dim taken from it is
    cut (grouped key/value heads, a reshape's split, a slice), with how many
    calls and which layers: a 32-layer model's attentions say it once."""
    grouped: dict[tuple, list[str]] = {}
    for edge in graph.slice_edges:
        target_axis = assignment.class_axis.get(edge.target)
        source_axis = assignment.class_axis.get(edge.source)
        if target_axis is None or source_axis == target_axis:
            continue
        key = (
            edge.reason,
            graph.classes[edge.source].size,
            graph.classes[edge.target].size,
            target_axis,
        )
        layer = graph.tensor_layers[edge.tensor] if graph.tensor_layers else ""
        grouped.setdefault(key, []).append(layer or "(outside any layer)")
    notes = []
    for (reason, source, target, axis), layers in grouped.items():
        where = _calls_in(layers)
        if reason == "repeat":
            notes.append(
                f"GQA/MQA: {source} key/value heads cannot be split over "
                f"{axis!r} (size {sizes[axis]}); they are replicated and each "
                "device slices the query-head groups it owns (one all-reduce "
                f"of the key/value activations in the backward pass){where}."
            )
        else:
            notes.append(
                f"A dimension of size {source} is kept whole on {axis!r} while "
                f"the dimension taken from it ({reason}, size {target}) is split "
                f"over {axis!r}: each device slices its part locally, and the "
                f"gradient is all-reduced in the backward pass{where}."
            )
    return notes


def _calls_in(layers: list[str]) -> str:
    """`" (N calls: in 'a', 'b', ...)"`, naming up to four layers in call
    order."""
    named = list(dict.fromkeys(layers))
    shown = ", ".join(repr(layer) for layer in named[:4])
    more = f" and {len(named) - 4} more" if len(named) > 4 else ""
    count = f"{len(layers)} call{'s' if len(layers) > 1 else ''}"
    return f" ({count}: in {shown}{more})"


def plan_notes(graph, mesh, assignment, roles, cost: PlanCost) -> list[str]:
    """The plan's notes: what was kept whole and why, and the estimate."""
    notes = batch_notes(graph, mesh, assignment)
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    notes += slice_edge_notes(graph, assignment, sizes)
    notes += expert_notes(graph, sizes, assignment, roles)
    for cls_id, role in roles.items():
        if role != "vocab":
            continue
        cls = graph.classes[cls_id]
        if cls_id not in assignment.class_axis:
            bad = [n for n, s in sizes.items() if s > 1 and cls.size % s]
            if bad:
                notes.append(
                    f"Vocabulary of {cls.size} does not divide mesh axis "
                    f"{bad[0]!r} (size {sizes[bad[0]]}): the embedding is kept "
                    "whole along it (replicated, or FSDP-sharded on another dim). "
                    "Pad the vocabulary to a multiple to shard it."
                )
    unread = [graph.tensors[t].name for t in graph.unread]
    if unread:
        notes.append(
            f"{len(unread)} variable(s) no equation of the step reads (e.g. "
            f"{unread[0]!r}): they get no gradient and are stored cut over "
            "every axis they divide, at no communication cost."
        )
    for name, count in graph.unknown_primitives:
        notes.append(
            f"Unknown primitive {name!r} ({count}x): its tensors' axes were left "
            "unsharded (conservative)."
        )
    repeated = repeated_products_note(graph, mesh, assignment)
    if repeated:
        notes.append(repeated)
    # The memory per device is the estimate's note (it counts the levers).
    notes.append(
        f"Estimated communication per step and device: "
        f"{format_bytes(cost.communication_bytes)} ("
        + ", ".join(
            f"{a} {format_bytes(b)}" for a, b in cost.communication_by_axis.items()
        )
        + ")."
    )
    return notes


# The price the search gives a repeated FLOP, in bytes moved.
FLOP_PRICE_BYTES = PlannerOptions.replicated_flop_cost


def repeated_products_note(graph, mesh, assignment) -> str | None:
    """Where the plan repeats matrix products on the devices of an axis
    instead of splitting them (devices left idle for that share of the
    step), by how much, in which layers, and the price that chose it."""
    axes = planning_axes(mesh)
    repeated = repeated_products(graph, axes, assignment)
    if not repeated:
        return None
    by_layer: dict[str, float] = {}
    for event, flops in repeated:
        layer = graph.tensor_layers[event.tensor] if graph.tensor_layers else ""
        layer = layer or "(outside any layer)"
        by_layer[layer] = by_layer.get(layer, 0.0) + flops
    total = sum(by_layer.values())
    products = sum(
        contraction_flops(graph, e)
        for e in graph.comm_events
        if e.kind == "contract" and e.phase == "forward"
    )
    even = products / mesh.device_count
    share = (
        f" ({100 * total / even:.0f} % more than an even split of the step's products)"
        if even
        else ""
    )
    largest = sorted(by_layer.items(), key=lambda item: -item[1])[:3]
    return (
        f"Matrix products repeated on the devices of an axis instead of split: "
        f"{total:.3g} forward FLOPs per step and device{share}, most in "
        + ", ".join(f"{name!r} ({flops:.3g})" for name, flops in largest)
        + f". The search prices a repeated FLOP at {FLOP_PRICE_BYTES:g} byte "
        "moved (with or without a hardware profile, which then also picks "
        "the levers and the mesh by estimated step time): cutting these "
        "moves more bytes than they cost at that price, or does not fit."
    )
