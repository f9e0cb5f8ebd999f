"""The mixed-integer program behind `search.search`.

The program encodes `cost_model.evaluate` exactly: binary `x[c, a]` shards
axis class `c` on mesh axis `a`; binary `y[p, a]` adds FSDP storage sharding
of parameter `p` over `a`. A tensor's per-device bytes depend on which mesh
axes shard it, a product over axes; it is linearised with one-hot "pattern"
variables `z[t, S]` over the subsets `S` of mesh axes (meshes have few axes),
and costs that need "event fires on axis a AND tensor is cut by S" use the
standard AND linearisation. The objective is communication bytes plus the
penalty for replicated heavy math (or, compute first, the least replicated
math, then the bytes); the memory budget, over the whole peak of a step
(`peak_budget.py`), is a constraint.
"""

from __future__ import annotations

import itertools
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
    MeshAxis,
    PlannerOptions,
    contraction_flops,
    covering,
    iteration_classes,
    joined_moves,
    mesh_axes,
    offers_table_exchanges,
    table_exchanges,
)
from keras_autoshard.planner.linear_program import InfeasibleError, LinearProgram
from keras_autoshard.planner.peak_budget import add_peak_budget
from keras_autoshard.planner.pins import Pins
from keras_autoshard.planner.symmetry import repeated_blocks

logger = logging.getLogger(__name__)

# Smallest preference for leaving a class unsharded when nothing else decides.
_TIE_BREAK_BYTES = 1.0
# Branch-and-bound nodes a budgeted search may explore. Measured: planning
# Llama-2-70B on 32x8 (H100-80GB), HiGHS spent its 20 s time limit on the
# attempt without rematerialization and kept its incumbent (planning 32 s);
# with this limit it stops there after 15 s (planning 24.7 s). A search that
# reaches it uses its best plan found and logs "MILP stopped early".
BUDGET_NODE_LIMIT = 50
# Share of the least replicated compute a compute-first solve may give up
# (the solver's own tolerance).
_COMPUTE_SLACK = 1e-6


class Program:
    """Builds the MILP for one graph and mesh."""

    def __init__(self, graph, axes, options, pins, batch_split="forced"):
        self.graph: AxisGraph = graph
        self.batch_split = batch_split
        self.batch_vars: list[int] = []
        self.axes: tuple[MeshAxis, ...] = axes
        self.sizes = {a.name: a.size for a in axes}
        self.options: PlannerOptions = options
        self.pins: Pins = pins
        self.lp = LinearProgram()
        self.x: dict[tuple[int, str], int] = {}
        self.y: dict[tuple[str, str], dict[int, int]] = {}  # → {dim: var}
        self._patterns: dict[tuple, dict[frozenset, int] | None] = {}
        # Replicated-math penalty variables → the penalty each avoids.
        self.compute_splits: dict[int, float] = {}

    # ------------------------------------------------------------ variables
    def add_class_vars(self) -> None:
        eligible = eligible_classes(self.graph)
        input_batch_classes = batch_input_classes(self.graph)
        batch_classes = batch_carrying_classes(self.graph)
        for cls in self.graph.classes:
            if cls.id not in eligible or cls.unshardable_reason is not None:
                continue
            for axis in self.axes:
                if cls.size % axis.size:
                    continue
                if (axis.data_only or axis.members) and cls.id not in batch_classes:
                    continue
                if axis.model_only and cls.id in batch_classes:
                    continue
                pinned = self.pins.class_axis.get(cls.id, "free")
                if pinned != "free" and pinned != axis.name:
                    continue
                lower = 1.0 if pinned == axis.name else 0.0
                var = self.lp.add_var(cost=_TIE_BREAK_BYTES, lower=lower, integer=True)
                self.x[(cls.id, axis.name)] = var
            # Each data axis splits the batch whenever the batch divides (by
            # itself or within an axis spanning it): forced, or (when forcing
            # it cannot hold) strongly preferred.
            if cls.id not in input_batch_classes or cls.id in self.pins.class_axis:
                continue
            for data_axis in self.axes:
                if not data_axis.data_only:
                    continue
                splits = [
                    self.x[(cls.id, a.name)]
                    for a in covering(self.axes, data_axis.name)
                    if (cls.id, a.name) in self.x
                ]
                if splits and self.batch_split == "forced":
                    self.lp.add_row(dict.fromkeys(splits, 1.0), lower=1.0)
                self.batch_vars += splits
        for cls_id, axis in self.pins.class_axis.items():
            if axis is not None and (cls_id, axis) not in self.x:
                raise InfeasibleError(
                    f"A rule asks to shard axis class {cls_id} on {axis!r}, which "
                    "the class's size or shardability does not allow."
                )
        for cls in self.graph.classes:
            row = {
                self.x[(cls.id, a.name)]: 1.0
                for a in self.axes
                if (cls.id, a.name) in self.x
            }
            self.lp.add_row(row, upper=1.0)

    def add_fsdp_vars(self) -> None:
        """`y[p, a, d]`: store parameter `p` cut over axis `a` along dim `d`.

        A parameter no equation reads (`graph.unread`) is stored cut over
        every axis a dim of it divides, unless a rule says otherwise:
        nothing gathers it and its update is elementwise, so the cut is
        free."""
        unread = set(self.graph.unread)
        for tensor in self.graph.params():
            if tensor.name in self.pins.no_fsdp:
                continue
            forced = {a: d for d, a in self.pins.fsdp.get(tensor.name, ())}
            if tensor.id in unread and not forced and not self._pinned(tensor):
                forced = _free_cut(tensor, mesh_axes(self.axes))
            vars_by_dim: dict[int, list[int]] = {}
            for axis in mesh_axes(self.axes):
                dims = (
                    [forced[axis.name]]
                    if axis.name in forced
                    else _fsdp_dims(tensor, axis.size)
                )
                lower = 1.0 if axis.name in forced else 0.0
                by_dim = {d: self.lp.add_var(lower=lower, integer=True) for d in dims}
                if not by_dim:
                    continue
                self.y[(tensor.name, axis.name)] = by_dim
                # One dim per axis, and only an axis the classes do not use
                # (by itself or within an axis spanning it).
                row = dict.fromkeys(by_dim.values(), 1.0)
                for c in set(tensor.dim_classes) - {None}:
                    for used in covering(self.axes, axis.name):
                        if (c, used.name) in self.x:
                            row[self.x[(c, used.name)]] = 1.0
                self.lp.add_row(row, upper=1.0)
                for d, var in by_dim.items():
                    vars_by_dim.setdefault(d, []).append(var)
            # One axis per dim, counting the class choice for that dim.
            for d, fsdp_vars in vars_by_dim.items():
                row = dict.fromkeys(fsdp_vars, 1.0)
                dim_class = tensor.dim_classes[d]
                for other in self.axes:
                    if (dim_class, other.name) in self.x:
                        row[self.x[(dim_class, other.name)]] = 1.0
                self.lp.add_row(row, upper=1.0)

    def add_conflicts(self) -> None:
        seen = set()
        for tensor in self.graph.tensors:
            classes = frozenset(c for c in tensor.dim_classes if c is not None)
            if len(classes) < 2 or classes in seen:
                continue
            seen.add(classes)
            # Each mesh axis cuts at most one dim, by itself or spanned.
            for axis in mesh_axes(self.axes):
                row = self._cuts_over(classes, axis.name)
                if len(row) > 1:
                    self.lp.add_row(row, upper=1.0)

    def _cuts_over(self, classes, axis_name: str) -> dict[int, float]:
        """`{x: 1}` for each way one of `classes` is cut over mesh axis
        `axis_name`, by itself or within an axis spanning it."""
        return {
            self.x[(c, used.name)]: 1.0
            for c in classes
            for used in covering(self.axes, axis_name)
            if (c, used.name) in self.x
        }

    def add_grouped_conv_rule(self) -> None:
        """Where a grouped convolution's input has its batch (or any dim but
        its channels) cut, every mesh axis must cut some dim of it: XLA
        miscomputes the filter gradient otherwise (see `GroupedConv`)."""
        for conv in self.graph.grouped_convs:
            tensor = self.graph.tensors[conv.tensor]
            classes = {c for c in tensor.dim_classes if c is not None}
            feature = tensor.dim_classes[conv.feature_dim]
            others = classes - {feature}
            for cut_axis in self.axes:
                for cls in others:
                    cut = self.x.get((cls, cut_axis.name))
                    if cut is None:
                        continue
                    for axis in mesh_axes(self.axes):
                        row = self._cuts_over(classes, axis.name)
                        row[cut] = row.get(cut, 0.0) - 1.0
                        self.lp.add_row(row, lower=0.0)

    def add_symmetry(self) -> None:
        """Identical repeated blocks take identical decisions (see
        `symmetry.py`): each copy's classes and storage cuts equal the first
        copy's, dim by dim and axis by axis."""
        for family in repeated_blocks(self.graph):
            first = family[0]
            for block in family[1:]:
                for reference, tensor in zip(first, block):
                    self._tie_classes(reference, tensor)
                    self._tie_storage(reference, tensor)

    def _tie_classes(self, reference: TensorNode, tensor: TensorNode) -> None:
        for c0, c1 in zip(reference.dim_classes, tensor.dim_classes):
            if c0 is None or c1 is None or c0 == c1:
                continue
            for axis in self.axes:
                self._equal(self.x.get((c0, axis.name)), self.x.get((c1, axis.name)))

    def _tie_storage(self, reference: TensorNode, tensor: TensorNode) -> None:
        for axis in self.axes:
            by0 = self.y.get((reference.name, axis.name), {})
            by1 = self.y.get((tensor.name, axis.name), {})
            for dim in set(by0) | set(by1):
                self._equal(by0.get(dim), by1.get(dim))

    def _equal(self, a: int | None, b: int | None) -> None:
        """Binary variables `a` and `b` (None: fixed at 0) take one value."""
        if a is None and b is None:
            return
        if a is None or b is None:
            self.lp.add_row({a if b is None else b: 1.0}, upper=0.0)
            return
        self.lp.add_row({a: 1.0, b: -1.0}, lower=0.0, upper=0.0)

    # ------------------------------------------------------------- patterns
    def shard_count_terms(self, tensor: TensorNode, axis: str, fsdp: bool):
        terms = {
            self.x[(c, axis)]: 1.0
            for c in set(tensor.dim_classes) - {None}
            if (c, axis) in self.x
        }
        if fsdp and tensor.kind == "param":
            for var in self.y.get((tensor.name, axis), {}).values():
                terms[var] = 1.0
        return terms

    def pattern(self, tensor: TensorNode, fsdp: bool) -> dict[frozenset, int] | None:
        """One-hot over subsets of mesh axes cutting `tensor`; None if constant."""
        classes = frozenset(c for c in tensor.dim_classes if c is not None)
        name = tensor.name if (fsdp and tensor.kind == "param") else None
        key = (classes, name)
        if key in self._patterns:
            return self._patterns[key]
        counts = {
            a.name: self.shard_count_terms(tensor, a.name, fsdp) for a in self.axes
        }
        free_axes = [a for a in self.sizes if counts[a]]
        if not free_axes:
            self._patterns[key] = None
            return None
        pattern = {}
        for r in range(len(free_axes) + 1):
            for subset in itertools.combinations(free_axes, r):
                pattern[frozenset(subset)] = self.lp.add_var()
        self.lp.add_row({v: 1.0 for v in pattern.values()}, lower=1.0, upper=1.0)
        for axis in free_axes:
            row = {v: 1.0 for s, v in pattern.items() if axis in s}
            for var, coefficient in counts[axis].items():
                row[var] = row.get(var, 0.0) - coefficient
            self.lp.add_row(row, lower=0.0, upper=0.0)
        self._patterns[key] = pattern
        return pattern

    def bytes_terms(self, tensor: TensorNode, fsdp: bool, scale: float = 1.0):
        """(constant, {var: coefficient}) of the tensor's per-device bytes."""
        pattern = self.pattern(tensor, fsdp)
        if pattern is None:
            return scale * tensor.nbytes, {}
        return 0.0, {
            v: scale * tensor.nbytes / math.prod(self.sizes[a] for a in s)
            for s, v in pattern.items()
        }

    def _pinned(self, tensor: TensorNode) -> bool:
        return any(c in self.pins.class_axis for c in tensor.dim_classes)

    def add_conditional_bytes(self, trigger: int, tensor: TensorNode, weight: float):
        """Cost weight × tensor bytes when `trigger` is 1 (AND-linearised)."""
        pattern = self.pattern(tensor, fsdp=False)
        if pattern is None:
            self.lp.add_cost(trigger, weight * tensor.nbytes)
            return
        for subset, z in pattern.items():
            coefficient = (
                weight * tensor.nbytes / math.prod(self.sizes[a] for a in subset)
            )
            both = self.lp.add_var(cost=coefficient)
            self.lp.add_row({both: 1.0, trigger: -1.0, z: -1.0}, lower=-1.0)

    # ---------------------------------------------------------------- costs
    def add_communication(self) -> None:
        for event in self.graph.comm_events:
            tensor = self.graph.tensors[event.tensor]
            for axis in self.axes:
                xs = [
                    self.x[(c, axis.name)]
                    for c in event.classes
                    if (c, axis.name) in self.x
                ]
                if not xs:
                    continue
                fires = self.lp.add_var()
                for x in xs:
                    self.lp.add_row({fires: 1.0, x: -1.0}, lower=0.0)
                self.add_conditional_bytes(fires, tensor, event.multiplicity)
        for edge in self.graph.slice_edges:
            tensor = self.graph.tensors[edge.tensor]
            for axis in self.axes:
                target = self.x.get((edge.target, axis.name))
                source = self.x.get((edge.source, axis.name))
                if source is not None:
                    row = {source: -1.0}
                    if target is not None:
                        row[target] = 1.0
                    self.lp.add_row(row, lower=0.0)
                    if edge.joined:
                        self.add_conditional_bytes(source, tensor, joined_moves(tensor))
                if target is None or not tensor.requires_grad:
                    continue
                fires = self.lp.add_var()
                row = {fires: 1.0, target: -1.0}
                if source is not None:
                    row[source] = 1.0
                self.lp.add_row(row, lower=0.0)
                self.add_conditional_bytes(fires, tensor, 1.0)
        unread = set(self.graph.unread)
        for (name, axis), by_dim in self.y.items():
            tensor = self.graph.param(name)
            if tensor.id in unread:
                continue  # nothing gathers it
            pattern = self.pattern(tensor, fsdp=True)
            gathered = self.lp.add_var()  # this parameter is FSDP-cut over axis
            row = {gathered: 1.0}
            for y in by_dim.values():
                row[y] = -1.0
            self.lp.add_row(row, lower=0.0)
            for subset, z in pattern.items():
                if axis not in subset:
                    continue
                coefficient = tensor.nbytes / math.prod(self.sizes[a] for a in subset)
                both = self.lp.add_var(cost=coefficient)
                self.lp.add_row({both: 1.0, gathered: -1.0, z: -1.0}, lower=-1.0)

    def add_table_exchanges(self) -> None:
        """Credit FSDP-cut, otherwise replicated lookup tables (see
        `cost_model.TableExchange`) with the gradient all-reduce they avoid."""
        if not offers_table_exchanges(self.axes):
            return
        for exchange in table_exchanges(self.graph):
            table = self.graph.param(exchange.param)
            event = self.graph.comm_events[exchange.gradient_event]
            for axis in self.axes:
                saving = exchange.saving_bytes(self.graph, axis.size)
                hidden = [
                    var
                    for dim, var in self.y.get((table.name, axis.name), {}).items()
                    if dim != exchange.indexed_dim
                ]
                triggers = [
                    self.x[(c, axis.name)]
                    for c in event.classes
                    if (c, axis.name) in self.x
                ]
                if saving <= 0 or not hidden or not triggers:
                    continue
                trade = self.lp.add_var(cost=-saving)
                self.lp.add_row({trade: 1.0, **{v: -1.0 for v in hidden}}, upper=0.0)
                self.lp.add_row({trade: 1.0, **{v: -1.0 for v in triggers}}, upper=0.0)
                for c in set(table.dim_classes) - {None}:
                    for other in self.axes:
                        if (c, other.name) in self.x:
                            self.lp.add_row(
                                {trade: 1.0, self.x[(c, other.name)]: 1.0}, upper=1.0
                            )
                cut_elsewhere = [
                    var
                    for (name, axis_name), by_dim in self.y.items()
                    if name == table.name
                    for dim, var in by_dim.items()
                    if axis_name != axis.name or dim == exchange.indexed_dim
                ]
                for var in cut_elsewhere:
                    self.lp.add_row({trade: 1.0, var: 1.0}, upper=1.0)

    def add_replicated_math_penalty(self) -> None:
        device_count = math.prod(a.size for a in mesh_axes(self.axes))
        for event in self.graph.comm_events:
            if event.kind != "contract" or event.phase != "forward":
                continue
            flops = contraction_flops(self.graph, event)
            classes = iteration_classes(self.graph, event)
            for axis in self.axes:
                xs = [
                    self.x[(c, axis.name)] for c in classes if (c, axis.name) in self.x
                ]
                if not xs:
                    continue
                # The mesh axes it splits the work over (`evaluate`'s sum).
                split_share = sum(1 - 1 / self.sizes[name] for name in axis.covers)
                penalty = (
                    self.options.replicated_flop_cost
                    * flops
                    * split_share
                    / device_count
                )
                split = self.lp.add_var(cost=-penalty)
                self.compute_splits[split] = penalty
                row = {split: 1.0}
                for x in xs:
                    row[x] = -1.0
                self.lp.add_row(row, upper=0.0)

    def add_batch_preference(self) -> None:
        """Reward each split of an input's batch dim over a data axis by more
        than every other cost together: any plan that splits the batch beats
        every plan that does not, and among those the costs decide."""
        if self.batch_split != "preferred" or not self.batch_vars:
            return
        positive = sum(
            cost * self.lp.upper[var]
            for var, cost in enumerate(self.lp.costs)
            if cost > 0
        )
        for var in self.batch_vars:
            self.lp.add_cost(var, -(positive + 1.0))

    # ---------------------------------------------------------------- solve
    def _hold_least_replicated_math(self, limits) -> None:
        """Solve for the least compute repeated on several devices alone
        (the budget still holding), then keep every later solve to it: the
        costs then choose only among plans that leave no more devices idle."""
        costs = self.lp.costs
        self.lp.costs = [0.0] * len(costs)
        for var, penalty in self.compute_splits.items():
            self.lp.costs[var] = -penalty
        try:
            values = self.lp.solve(**limits)
        finally:
            self.lp.costs = costs
        avoided = sum(p * values[v] for v, p in self.compute_splits.items())
        self.lp.add_row(dict(self.compute_splits), lower=avoided * (1 - _COMPUTE_SLACK))

    def solve(self, compute_first: bool = False) -> Assignment:
        # Under a budget the program may have a feasible relaxation and no
        # integer solution (a lever that cannot fit); proving that can take
        # the solver long, so its search is bounded (`BUDGET_NODE_LIMIT`).
        budgeted = self.options.memory_budget_bytes is not None
        limits = dict(
            time_limit_s=self.options.time_limit_s,
            node_limit=BUDGET_NODE_LIMIT if budgeted else None,
        )
        if compute_first and self.compute_splits:
            self._hold_least_replicated_math(limits)
        values = self.lp.solve(**limits)
        class_axis = {c: a for (c, a), var in self.x.items() if values[var] > 0.5}
        fsdp: dict[str, list[tuple[int, str]]] = {}
        for (name, axis), by_dim in self.y.items():
            for dim, var in by_dim.items():
                if values[var] > 0.5:
                    fsdp.setdefault(name, []).append((dim, axis))
        return Assignment(
            class_axis=class_axis,
            fsdp={k: tuple(v) for k, v in fsdp.items()},
            search=self.lp.outcome,
        )


def solve_program(
    graph,
    axes,
    options,
    pins,
    batch_split,
    symmetric=True,
    remat=frozenset(),
    micro_batches=1,
    compute_first=False,
) -> Assignment:
    """Build and solve the program for one attempt (`search._search_attempts`)."""
    if micro_batches > 1:
        # A micro-batch's rows must divide over the batch's cut; the data
        # axes' (`levers.accumulation_options`), not a spanning axis's.
        axes = mesh_axes(axes)
    program = Program(graph, axes, options, pins, batch_split)
    program.add_class_vars()
    program.add_fsdp_vars()
    if symmetric:
        program.add_symmetry()
    program.add_conflicts()
    program.add_grouped_conv_rule()
    program.add_communication()
    program.add_table_exchanges()
    program.add_replicated_math_penalty()
    add_peak_budget(program, remat, micro_batches)
    program.add_batch_preference()
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
