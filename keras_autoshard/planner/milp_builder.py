"""Builds the mixed-integer program behind `search.search` (`MilpProgram`).

The program encodes `cost_model.evaluate` exactly: the classes' and the
parameters' storage cuts as variables (`add_class_vars`, `add_fsdp_vars`),
the rules they must keep (one dim per mesh axis, grouped convolutions,
identical blocks alike), and as the objective the communication bytes plus
the penalty for replicated heavy math (or, compute first, the least
replicated math, then the bytes); the memory budget, over the whole peak of
a step (`peak_budget.py`), is a constraint.
"""

from __future__ import annotations

import logging
import math

from keras_autoshard.graph.axis_graph import AxisGraph, TensorNode
from keras_autoshard.planner.batch_classes import (
    batch_carrying_classes,
    eligible_classes,
)
from keras_autoshard.planner.batch_classes import (
    input_batch_classes as batch_input_classes,
)
from keras_autoshard.planner.cost_model import (
    Assignment,
    PlannerOptions,
    contraction_flops,
    iteration_classes,
    joined_moves,
    offers_table_exchanges,
    table_exchanges,
)
from keras_autoshard.planner.linear_program import InfeasibleError
from keras_autoshard.planner.mesh_axis import MeshAxis, covering, mesh_axes
from keras_autoshard.planner.milp_program import MilpProgram
from keras_autoshard.planner.peak_budget import add_peak_budget
from keras_autoshard.planner.pins import Pins
from keras_autoshard.planner.symmetry import repeated_blocks

logger = logging.getLogger(__name__)

# Smallest preference for leaving a class unsharded when nothing else decides.
_TIE_BREAK_BYTES = 1.0


def add_class_vars(program: MilpProgram) -> None:
    eligible = eligible_classes(program.graph)
    input_batch_classes = batch_input_classes(program.graph)
    batch_classes = batch_carrying_classes(program.graph)
    for cls in program.graph.classes:
        if cls.id not in eligible or cls.unshardable_reason is not None:
            continue
        for axis in program.axes:
            if cls.size % axis.size:
                continue
            if (axis.data_only or axis.members) and cls.id not in batch_classes:
                continue
            if axis.model_only and cls.id in batch_classes:
                continue
            pinned = program.pins.class_axis.get(cls.id, "free")
            if pinned != "free" and pinned != axis.name:
                continue
            lower = 1.0 if pinned == axis.name else 0.0
            var = program.lp.add_var(cost=_TIE_BREAK_BYTES, lower=lower, integer=True)
            program.x[(cls.id, axis.name)] = var
        # Each data axis splits the batch whenever the batch divides (by
        # itself or within an axis spanning it): forced, or (when forcing
        # it cannot hold) strongly preferred.
        if cls.id not in input_batch_classes or cls.id in program.pins.class_axis:
            continue
        for data_axis in program.axes:
            if not data_axis.data_only:
                continue
            splits = [
                program.x[(cls.id, a.name)]
                for a in covering(program.axes, data_axis.name)
                if (cls.id, a.name) in program.x
            ]
            if splits and program.batch_split == "forced":
                program.lp.add_row(dict.fromkeys(splits, 1.0), lower=1.0)
            program.batch_vars += splits
    for cls_id, axis in program.pins.class_axis.items():
        if axis is not None and (cls_id, axis) not in program.x:
            raise InfeasibleError(
                f"A rule asks to shard axis class {cls_id} on {axis!r}, which "
                "the class's size or shardability does not allow."
            )
    for cls in program.graph.classes:
        row = {
            program.x[(cls.id, a.name)]: 1.0
            for a in program.axes
            if (cls.id, a.name) in program.x
        }
        program.lp.add_row(row, upper=1.0)


def add_fsdp_vars(program: MilpProgram) -> None:
    """`y[p, a, d]`: store parameter `p` cut over axis `a` along dim `d`.

    A parameter no equation reads (`graph.unread`) is stored cut over
    every axis a dim of it divides, unless a rule says otherwise:
    nothing gathers it and its update is elementwise, so the cut is
    free."""
    unread = set(program.graph.unread)
    for tensor in program.graph.params():
        if tensor.name in program.pins.no_fsdp:
            continue
        forced = {a: d for d, a in program.pins.fsdp.get(tensor.name, ())}
        if tensor.id in unread and not forced and not program.is_pinned(tensor):
            forced = _free_cut(tensor, mesh_axes(program.axes))
        vars_by_dim: dict[int, list[int]] = {}
        for axis in mesh_axes(program.axes):
            dims = (
                [forced[axis.name]]
                if axis.name in forced
                else _fsdp_dims(tensor, axis.size)
            )
            lower = 1.0 if axis.name in forced else 0.0
            by_dim = {d: program.lp.add_var(lower=lower, integer=True) for d in dims}
            if not by_dim:
                continue
            program.y[(tensor.name, axis.name)] = by_dim
            # One dim per axis, and only an axis the classes do not use
            # (by itself or within an axis spanning it).
            row = dict.fromkeys(by_dim.values(), 1.0)
            for c in set(tensor.dim_classes) - {None}:
                for used in covering(program.axes, axis.name):
                    if (c, used.name) in program.x:
                        row[program.x[(c, used.name)]] = 1.0
            program.lp.add_row(row, upper=1.0)
            for d, var in by_dim.items():
                vars_by_dim.setdefault(d, []).append(var)
        # One axis per dim, counting the class choice for that dim.
        for d, fsdp_vars in vars_by_dim.items():
            row = dict.fromkeys(fsdp_vars, 1.0)
            dim_class = tensor.dim_classes[d]
            for other in program.axes:
                if (dim_class, other.name) in program.x:
                    row[program.x[(dim_class, other.name)]] = 1.0
            program.lp.add_row(row, upper=1.0)


def add_conflicts(program: MilpProgram) -> None:
    seen = set()
    for tensor in program.graph.tensors:
        classes = frozenset(c for c in tensor.dim_classes if c is not None)
        if len(classes) < 2 or classes in seen:
            continue
        seen.add(classes)
        # Each mesh axis cuts at most one dim, by itself or spanned.
        for axis in mesh_axes(program.axes):
            row = program.cuts_over(classes, axis.name)
            if len(row) > 1:
                program.lp.add_row(row, upper=1.0)


def add_grouped_conv_rule(program: MilpProgram) -> None:
    """Where a grouped convolution's input has its batch (or any dim but
    its channels) cut, every mesh axis must cut some dim of it: XLA
    miscomputes the filter gradient otherwise (see `GroupedConv`)."""
    for conv in program.graph.grouped_convs:
        tensor = program.graph.tensors[conv.tensor]
        classes = {c for c in tensor.dim_classes if c is not None}
        feature = tensor.dim_classes[conv.feature_dim]
        others = classes - {feature}
        for cut_axis in program.axes:
            for cls in others:
                cut = program.x.get((cls, cut_axis.name))
                if cut is None:
                    continue
                for axis in mesh_axes(program.axes):
                    row = program.cuts_over(classes, axis.name)
                    row[cut] = row.get(cut, 0.0) - 1.0
                    program.lp.add_row(row, lower=0.0)


def add_symmetry(program: MilpProgram) -> None:
    """Identical repeated blocks take identical decisions (see
    `symmetry.py`): each copy's classes and storage cuts equal the first
    copy's, dim by dim and axis by axis."""
    for family in repeated_blocks(program.graph):
        first = family[0]
        for block in family[1:]:
            for reference, tensor in zip(first, block):
                _tie_classes(program, reference, tensor)
                _tie_storage(program, reference, tensor)


def _tie_classes(
    program: MilpProgram, reference: TensorNode, tensor: TensorNode
) -> None:
    for c0, c1 in zip(reference.dim_classes, tensor.dim_classes):
        if c0 is None or c1 is None or c0 == c1:
            continue
        for axis in program.axes:
            program.add_equal(
                program.x.get((c0, axis.name)), program.x.get((c1, axis.name))
            )


def _tie_storage(
    program: MilpProgram, reference: TensorNode, tensor: TensorNode
) -> None:
    for axis in program.axes:
        by0 = program.y.get((reference.name, axis.name), {})
        by1 = program.y.get((tensor.name, axis.name), {})
        for dim in set(by0) | set(by1):
            program.add_equal(by0.get(dim), by1.get(dim))


def add_communication(program: MilpProgram) -> None:
    for event in program.graph.comm_events:
        tensor = program.graph.tensors[event.tensor]
        for axis in program.axes:
            xs = [
                program.x[(c, axis.name)]
                for c in event.classes
                if (c, axis.name) in program.x
            ]
            if not xs:
                continue
            fires = program.lp.add_var()
            for x in xs:
                program.lp.add_row({fires: 1.0, x: -1.0}, lower=0.0)
            program.add_conditional_bytes(fires, tensor, event.multiplicity)
    for edge in program.graph.slice_edges:
        tensor = program.graph.tensors[edge.tensor]
        for axis in program.axes:
            target = program.x.get((edge.target, axis.name))
            source = program.x.get((edge.source, axis.name))
            if source is not None:
                row = {source: -1.0}
                if target is not None:
                    row[target] = 1.0
                program.lp.add_row(row, lower=0.0)
                if edge.joined:
                    program.add_conditional_bytes(source, tensor, joined_moves(tensor))
            if target is None or not tensor.requires_grad:
                continue
            fires = program.lp.add_var()
            row = {fires: 1.0, target: -1.0}
            if source is not None:
                row[source] = 1.0
            program.lp.add_row(row, lower=0.0)
            program.add_conditional_bytes(fires, tensor, 1.0)
    unread = set(program.graph.unread)
    for (name, axis), by_dim in program.y.items():
        tensor = program.graph.param(name)
        if tensor.id in unread:
            continue  # nothing gathers it
        pattern = program.pattern(tensor, fsdp=True)
        gathered = program.lp.add_var()  # this parameter is FSDP-cut over axis
        row = {gathered: 1.0}
        for y in by_dim.values():
            row[y] = -1.0
        program.lp.add_row(row, lower=0.0)
        for subset, z in pattern.items():
            if axis not in subset:
                continue
            coefficient = tensor.nbytes / math.prod(program.sizes[a] for a in subset)
            both = program.lp.add_var(cost=coefficient)
            program.lp.add_row({both: 1.0, gathered: -1.0, z: -1.0}, lower=-1.0)


def add_table_exchanges(program: MilpProgram) -> None:
    """Credit FSDP-cut, otherwise replicated lookup tables (see
    `cost_model.TableExchange`) with the gradient all-reduce they avoid."""
    if not offers_table_exchanges(program.axes):
        return
    for exchange in table_exchanges(program.graph):
        table = program.graph.param(exchange.param)
        event = program.graph.comm_events[exchange.gradient_event]
        for axis in program.axes:
            saving = exchange.saving_bytes(program.graph, axis.size)
            hidden = [
                var
                for dim, var in program.y.get((table.name, axis.name), {}).items()
                if dim != exchange.indexed_dim
            ]
            triggers = [
                program.x[(c, axis.name)]
                for c in event.classes
                if (c, axis.name) in program.x
            ]
            if saving <= 0 or not hidden or not triggers:
                continue
            trade = program.lp.add_var(cost=-saving)
            program.lp.add_row({trade: 1.0, **{v: -1.0 for v in hidden}}, upper=0.0)
            program.lp.add_row({trade: 1.0, **{v: -1.0 for v in triggers}}, upper=0.0)
            for c in set(table.dim_classes) - {None}:
                for other in program.axes:
                    if (c, other.name) in program.x:
                        program.lp.add_row(
                            {trade: 1.0, program.x[(c, other.name)]: 1.0}, upper=1.0
                        )
            cut_elsewhere = [
                var
                for (name, axis_name), by_dim in program.y.items()
                if name == table.name
                for dim, var in by_dim.items()
                if axis_name != axis.name or dim == exchange.indexed_dim
            ]
            for var in cut_elsewhere:
                program.lp.add_row({trade: 1.0, var: 1.0}, upper=1.0)


def add_replicated_math_penalty(program: MilpProgram) -> None:
    device_count = math.prod(a.size for a in mesh_axes(program.axes))
    for event in program.graph.comm_events:
        if event.kind != "contract" or event.phase != "forward":
            continue
        flops = contraction_flops(program.graph, event)
        classes = iteration_classes(program.graph, event)
        for axis in program.axes:
            xs = [
                program.x[(c, axis.name)]
                for c in classes
                if (c, axis.name) in program.x
            ]
            if not xs:
                continue
            # The mesh axes it splits the work over (`evaluate`'s sum).
            split_share = sum(1 - 1 / program.sizes[name] for name in axis.covers)
            penalty = (
                program.options.replicated_flop_cost
                * flops
                * split_share
                / device_count
            )
            split = program.lp.add_var(cost=-penalty)
            program.compute_splits[split] = penalty
            row = {split: 1.0}
            for x in xs:
                row[x] = -1.0
            program.lp.add_row(row, upper=0.0)


def add_batch_preference(program: MilpProgram) -> None:
    """Reward each split of an input's batch dim over a data axis by more
    than every other cost together: any plan that splits the batch beats
    every plan that does not, and among those the costs decide."""
    if program.batch_split != "preferred" or not program.batch_vars:
        return
    positive = sum(
        cost * program.lp.upper[var]
        for var, cost in enumerate(program.lp.costs)
        if cost > 0
    )
    for var in program.batch_vars:
        program.lp.add_cost(var, -(positive + 1.0))


def solve_program(
    graph: AxisGraph,
    axes: tuple[MeshAxis, ...],
    options: PlannerOptions,
    pins: Pins,
    batch_split: str,
    symmetric: bool = True,
    remat: frozenset[str] = frozenset(),
    micro_batches: int = 1,
    compute_first: bool = False,
) -> Assignment:
    """Build and solve the program for one attempt (`search._search_attempts`).

    Args:
        graph: The model's axis graph.
        axes: Mesh axes of size > 1.
        options: Budget and cost knobs.
        pins: Choices fixed by user rules.
        batch_split: `"forced"`, `"preferred"` or `"free"` (`MilpProgram`).
        symmetric: Tie identical repeated blocks (`add_symmetry`).
        remat: Layer calls rematerialized (what the budget keeps).
        micro_batches: Gradient accumulation parts the budget counts with.
        compute_first: Least replicated compute first, then the bytes.

    Returns:
        The optimal `Assignment`.

    Raises:
        InfeasibleError: When no sharding satisfies the rows.
    """
    if micro_batches > 1:
        # A micro-batch's rows must divide over the batch's cut; the data
        # axes' (`lever_options.accumulation_options`), not a spanning axis's.
        axes = mesh_axes(axes)
    program = MilpProgram(graph, axes, options, pins, batch_split)
    add_class_vars(program)
    add_fsdp_vars(program)
    if symmetric:
        add_symmetry(program)
    add_conflicts(program)
    add_grouped_conv_rule(program)
    add_communication(program)
    add_table_exchanges(program)
    add_replicated_math_penalty(program)
    add_peak_budget(program, remat, micro_batches)
    add_batch_preference(program)
    logger.info(
        "Planning MILP: %d variables, %d constraints",
        program.lp.num_vars,
        len(program.lp.rows),
    )
    return program.solve(compute_first)


def _free_cut(tensor: TensorNode, axes: tuple[MeshAxis, ...]) -> dict[str, int]:
    """Axis name → dim: each axis, largest first, on the largest dim of
    `tensor` it divides that no larger axis took."""
    cut: dict[str, int] = {}
    for axis in sorted(axes, key=lambda a: (-a.size, a.name)):
        dims = [d for d in _fsdp_dims(tensor, axis.size) if d not in cut.values()]
        if dims:
            cut[axis.name] = max(dims, key=lambda d: (tensor.shape[d], -d))
    return cut


def _fsdp_dims(tensor: TensorNode, axis_size: int) -> list[int]:
    """Dims of `tensor` that `axis_size` divides (candidates for FSDP)."""
    return [
        dim
        for dim, size in enumerate(tensor.shape)
        if size % axis_size == 0 and size >= axis_size
    ]
