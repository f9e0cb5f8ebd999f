"""Cost of a candidate sharding, as pure functions of the axis graph.

A candidate (`Assignment`) maps axis classes to mesh axes and may add
FSDP-style storage sharding of parameters. Its cost per training step:

- memory per device: parameters, gradients and optimizer slots (each cut by
  the mesh axes that shard the parameter), plus the activations the backward
  pass keeps (`kept_bytes`; the whole peak is `memory_model.py`);
- communication per device: for every comm event of the graph whose class is
  sharded on mesh axis `a`, an all-reduce over `a` of the event tensor's
  per-device bytes (the operand bytes the compiled report counts); for every
  slice edge used, an all-reduce of the sliced tensor in the backward pass
  (for a part of a join cut like the join, its rows moved between devices,
  `SliceEdge.joined`); for every FSDP-sharded parameter, an all-gather of
  its shard;
- replicated heavy math: FLOPs of contractions that a mesh axis leaves whole
  (every device repeats them), the work the search avoids first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from keras_autoshard.graph.axis_graph import AxisGraph, CommEvent, TensorNode
from keras_autoshard.planner.batch_classes import batch_carrying_classes
from keras_autoshard.planner.linear_program import SolveOutcome
from keras_autoshard.planner.mesh_axis import MeshAxis, mesh_axes
from keras_autoshard.planner.remat import gathered_param_terms, kept_terms


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A candidate sharding.

    Args:
        class_axis: Axis class id → mesh axis name.
        fsdp: Parameter name → ((dim, mesh axis), ...) storage-only sharding.
        activation_cuts: Activation tensor id → ((dim, mesh axis), ...) cut
            beyond its class's axis (sequence parallelism,
            `planner/sequence_parallel.py`).
        search: How the solver ended the program this sharding came from
            (`linear_program.SolveOutcome`; `None` for one made otherwise).
    """

    class_axis: Mapping[int, str]
    fsdp: Mapping[str, tuple[tuple[int, str], ...]] = dataclasses.field(
        default_factory=dict
    )
    activation_cuts: Mapping[int, tuple[tuple[int, str], ...]] = dataclasses.field(
        default_factory=dict
    )
    search: SolveOutcome | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the cost model and search.

    Args:
        memory_budget_bytes: Per-device limit on everything a device holds
            at the peak of a step (`planner/memory_model.py`): parameters,
            gradients, optimizer slots, kept activations, data and
            transient buffers; `None` for no limit.
        optimizer_slots: Optimizer state per parameter, in parameter copies
            (Adam: 2).
        replicated_flop_cost: Cost, in bytes of communication, of one FLOP
            that a mesh axis repeats on every device instead of splitting.
            0.25 (4 FLOPs per byte moved) makes devices split all large
            contractions while small ones (e.g. K/V projections with fewer
            heads than the axis) may stay whole.
        time_limit_s: Time limit for each solve of the exact solver; one
            stopped by it keeps the best plan found (a warning says so),
            one stopped with none is solved again with a longer limit
            (`linear_program.TIME_LIMIT_GROWTH`), then raises
            `SolverTimeLimitError`, never "nothing fits".
            Mixtral-8x7B on 8x8 is the one real size that reaches it: HiGHS
            holds its plan within a second but does not prove the last
            1e-6 of optimality within a minute.
        platform: The devices the plan is for (`"cpu"`, `"gpu"`, `"tpu"`):
            XLA:CPU runs half-precision arithmetic in float32, so a CPU
            plan's activations count at that size.
        hardware: The `HardwareProfile` planned for, if any.
        job: `"train"` (a training step), `"inference"` (`predict`) or
            `"generate"` (with a key/value cache): what the budget holds.
        minimize_peak: With no budget, make the peak per device the first
            term of the objective (used to say by how much nothing fits).
        rematerialize: `"auto"` (chosen only to fit the budget), `"none"`,
            `"all"` (every repeated-layer family) or a tuple of top-level
            layer names.
        sequence_parallel: Cut the token dim of the activations between
            tensor-parallel regions over the tensor-parallel axis
            (`planner/sequence_parallel.py`): `True`, `False`, or `"auto"`
            (only where the plan does not fit without it).
        gradient_accumulation_steps: `None` (chosen only when nothing else
            fits the budget) or a micro-batch count asked for.
        batch_over_model_axes: Where no data axis cuts the batch, let a
            model axis cut it (data parallelism over it) when that leaves
            less compute repeated on the devices (`search.search`);
            `False` keeps model axes for the model (`TensorParallel`).
    """

    memory_budget_bytes: int | None = None
    optimizer_slots: int = 2
    replicated_flop_cost: float = 0.25
    time_limit_s: float = 20.0
    platform: str = "cpu"
    hardware: Any = None
    job: str = "train"
    minimize_peak: bool = False
    rematerialize: Any = "auto"
    sequence_parallel: Any = False
    gradient_accumulation_steps: int | None = None
    batch_over_model_axes: bool = True


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """Per-device memory and per-step communication of an `Assignment`."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    communication_bytes: float
    communication_by_axis: Mapping[str, float]
    replicated_flops: float

    @property
    def state_bytes(self) -> int:
        """Parameters + optimizer state per device: what the budget limits."""
        return self.parameter_bytes + self.optimizer_bytes

    @property
    def memory_bytes(self) -> int:
        """State plus the gradient and activation estimates."""
        return self.state_bytes + self.gradient_bytes + self.activation_bytes


def tensor_axes(tensor: TensorNode, assignment: Assignment) -> tuple[str | None, ...]:
    """The mesh axis (or None) of each dim of `tensor` under `assignment`."""
    axes = [
        None if c is None else assignment.class_axis.get(c) for c in tensor.dim_classes
    ]
    if tensor.kind in ("param", "state") and tensor.name in assignment.fsdp:
        for dim, axis in assignment.fsdp[tensor.name]:
            axes[dim] = axis
    for dim, axis in assignment.activation_cuts.get(tensor.id, ()):
        axes[dim] = axis
    return tuple(axes)


def local_bytes(
    tensor: TensorNode,
    assignment: Assignment,
    sizes: Mapping[str, int],
    include_fsdp: bool = True,
) -> float:
    """Bytes of `tensor` held by one device."""
    if include_fsdp:
        axes = tensor_axes(tensor, assignment)
    else:
        axes = tensor_axes(tensor, dataclasses.replace(assignment, fsdp={}))
    divisor = math.prod(sizes[a] for a in axes if a is not None)
    return tensor.nbytes / divisor


def kept_bytes(
    graph: AxisGraph,
    assignment: Assignment,
    sizes: Mapping[str, int],
    half_as_single: bool = False,
    remat: frozenset[str] = frozenset(),
) -> float:
    """Bytes one device keeps for the backward pass: the graph's residuals
    (`graph/jaxpr/residuals.py`) that are activations under the
    rematerialized layers `remat` (`planner/remat.py`), each cut like its
    tensor, plus residuals no tensor holds (counted whole).

    `half_as_single`: see `kept_widening`."""
    return graph.other_residual_bytes + terms_bytes(
        graph, kept_terms(graph, remat), assignment, sizes, half_as_single, kept=True
    )


def terms_bytes(
    graph: AxisGraph,
    terms,
    assignment: Assignment,
    sizes: Mapping[str, int],
    half_as_single: bool = False,
    kept: bool = False,
) -> float:
    """Bytes one device holds of `(tensor id, bytes per tensor byte)`
    activation terms, each cut like its tensor and as wide as `widening`
    says, or `kept_widening` for residuals the backward pass keeps
    (`kept=True`)."""
    return sum(
        local_bytes(graph.tensors[tid], assignment, sizes)
        * factor
        * (
            kept_widening(graph, graph.tensors[tid], half_as_single)
            if kept
            else widening(graph.tensors[tid], half_as_single)
        )
        for tid, factor in terms
    )


def gathered_bytes(
    graph: AxisGraph,
    assignment: Assignment,
    sizes: Mapping[str, int],
    remat: frozenset[str] = frozenset(),
) -> float:
    """Bytes of FSDP-gathered weights one device keeps for the backward pass
    (`planner/remat.gathered_param_terms`): each kept weight's compute
    layout less its stored shard."""
    return sum(
        factor
        * (
            local_bytes(graph.tensors[tid], assignment, sizes, include_fsdp=False)
            - local_bytes(graph.tensors[tid], assignment, sizes)
        )
        for tid, factor in gathered_param_terms(graph, remat)
    )


def widening(tensor: TensorNode, half_as_single: bool) -> float:
    """2 for a 2-byte tensor when half floats run as float32, else 1.

    `half_as_single`: XLA:CPU runs bfloat16 and float16 arithmetic in
    float32 (its float normalisation), so the buffers a computation works in
    (a layer's output gradient, a loss's difference) are float32 there."""
    return 2.0 if half_as_single and tensor.itemsize == 2 else 1.0


def relaid_weights(graph: AxisGraph) -> list[TensorNode]:
    """Operands made from weights alone (no class of theirs carries the
    batch) that XLA copies into another layout for their matrix product
    (`AxisGraph.relaid_operands`): a `(heads, embed, head_dim)` attention
    kernel contracted over `embed`, a kernel read with its contracting dims
    listed out of order.

    XLA:CPU's default schedule (what `predict` and `generate` compile with
    on CPU; it orders for throughput) makes every computation of weights
    alone at the start of the program, so these copies are live together
    beside the first layers' activations: the zoo's Gemma, whose eight
    attention kernels are copied, on 8x1 held 2 MiB of them at the compiled
    forward step's peak (`xla_dump_to`'s buffer assignment), and the
    inference estimate, without them, was 0.74 of that peak."""
    batch_classes = batch_carrying_classes(graph)
    return [
        graph.tensors[tid]
        for tid in graph.relaid_operands
        if not batch_classes.intersection(graph.tensors[tid].dim_classes)
    ]


def kept_widening(graph: AxisGraph, tensor: TensorNode, half_as_single: bool) -> float:
    """How much wider than its own dtype a residual is kept: 2 for a
    2-byte operand of a matrix product or convolution when half floats run
    as float32, else 1.

    XLA:CPU computes a bfloat16 product in float32: it converts the
    operands and keeps that float32 copy for the backward pass's products
    too (a bfloat16 kernel cast, a normalised input, attention
    probabilities), while other bfloat16 residuals (a product's output
    before its activation function, a sine table) stay bfloat16. Measured
    on the zoo's Llama under `mixed_bfloat16` on 2x4 (`xla_dump_to`, the
    buffers live at the compiled step's peak)."""
    if not half_as_single or tensor.itemsize != 2:
        return 1.0
    return 2.0 if tensor.id in graph.matmul_operand_ids else 1.0


def contraction_flops(graph: AxisGraph, event: CommEvent) -> float:
    """FLOPs of the contraction behind a forward `contract` event."""
    out = graph.tensors[event.tensor]
    contracted = math.prod(graph.classes[c].size for c in event.classes)
    return 2.0 * math.prod(out.shape) * contracted * event.multiplicity


def iteration_classes(graph: AxisGraph, event: CommEvent) -> set[int]:
    """Classes that index a contraction's work: output dims and contracted dims."""
    out = graph.tensors[event.tensor]
    return {c for c in out.dim_classes if c is not None} | set(event.classes)


@dataclasses.dataclass(frozen=True)
class TableExchange:
    """An embedding table whose gradient all-reduce can be traded away.

    When a lookup table is otherwise replicated and FSDP-cut over one data
    axis only, along a non-indexed dim (its hidden dim), the partitioner neither
    all-gathers the table nor all-reduces its gradient: it moves the lookup's
    activations to the devices holding each slice instead (two all-to-alls of
    the lookup output, forward and backward; measured on KerasHub Gemma,
    Llama and GPT-2). Measured too: with a second mesh axis (data × model)
    XLA goes back to all-reducing the gradient and the trade costs more, so
    it is only offered on a mesh whose one axis (of size > 1) is a data axis.

    Args:
        param: The table's tensor name.
        indexed_dim: The looked-up (vocabulary) dim.
        output: Id of the lookup's output tensor.
        gradient_event: Index into `graph.comm_events` of the table's
            gradient all-reduce.
    """

    param: str
    indexed_dim: int
    output: int
    gradient_event: int

    def saving_bytes(self, graph: AxisGraph, axis_size: int) -> float:
        """Bytes per step this trade removes (negative: it would cost more)."""
        table = graph.param(self.param)
        event = graph.comm_events[self.gradient_event]
        removed = table.nbytes * event.multiplicity + table.nbytes / axis_size
        added = 2 * graph.tensors[self.output].nbytes / axis_size
        return removed - added


def offers_table_exchanges(axes: tuple[MeshAxis, ...]) -> bool:
    """Whether `TableExchange` applies on a mesh: one axis (> 1), a data axis."""
    axes = mesh_axes(axes)
    return len(axes) == 1 and axes[0].data_only


def storage_cut_only(tensor: TensorNode, assignment: Assignment) -> bool:
    """Whether `assignment` cuts `tensor` for storage (FSDP) and nothing else."""
    if any(c is not None and c in assignment.class_axis for c in tensor.dim_classes):
        return False
    return bool(assignment.fsdp.get(tensor.name))


def table_exchanges(graph: AxisGraph) -> list[TableExchange]:
    """Every lookup table of the graph with its output and gradient event."""
    events = graph.comm_events
    lookups = [e for e in events if e.kind == "gather" and e.phase == "forward"]
    backward_by_tensor: dict[int, list[int]] = {}
    for i, event in enumerate(events):
        if event.phase == "backward":
            backward_by_tensor.setdefault(event.tensor, []).append(i)
    found = []
    for table in graph.params():
        gradient = backward_by_tensor.get(table.id, [])
        if len(gradient) != 1:
            continue
        for event in lookups:
            if len(event.classes) != 1 or event.classes[0] not in table.dim_classes:
                continue
            found.append(
                TableExchange(
                    table.name,
                    table.dim_classes.index(event.classes[0]),
                    event.tensor,
                    gradient[0],
                )
            )
            break
    return found


def table_exchange_applies(
    graph: AxisGraph, exchange: TableExchange, assignment: Assignment, axis: str
) -> bool:
    """Whether `assignment` makes the trade of `exchange` on `axis`."""
    if not storage_cut_only(graph.param(exchange.param), assignment):
        return False
    cuts = assignment.fsdp[exchange.param]
    # Only a table cut over this one axis, along a non-indexed dim (measured:
    # also cutting it over another axis brings the all-reduce back).
    hidden_cut = (
        len(cuts) == 1 and cuts[0][1] == axis and cuts[0][0] != (exchange.indexed_dim)
    )
    event = graph.comm_events[exchange.gradient_event]
    return hidden_cut and axis in _axes_of(event.classes, assignment)


def evaluate(
    graph: AxisGraph,
    axes: tuple[MeshAxis, ...],
    assignment: Assignment,
    options: PlannerOptions,
) -> PlanCost:
    """Memory and communication of `assignment` (see the module docstring).

    Args:
        graph: The model's axis graph.
        axes: Mesh axes (size > 1) that may shard.
        assignment: The candidate.
        options: Cost-model knobs.

    Returns:
        A `PlanCost`.
    """
    sizes = {a.name: a.size for a in axes}
    param_bytes = grad_bytes = opt_bytes = 0.0
    unread = set(graph.unread)
    for tensor in graph.tensors:
        if tensor.kind not in ("param", "state"):
            continue
        shard = local_bytes(tensor, assignment, sizes)
        param_bytes += shard
        if tensor.kind == "param":
            if tensor.id not in unread:
                grad_bytes += shard
            opt_bytes += options.optimizer_slots * shard
    activation_bytes = kept_bytes(graph, assignment, sizes)
    by_axis = dict.fromkeys(sizes, 0.0)
    for event in graph.comm_events:
        tensor = graph.tensors[event.tensor]
        for axis in _axes_of(event.classes, assignment):
            by_axis[axis] += event.multiplicity * local_bytes(
                tensor, assignment, sizes, include_fsdp=False
            )
    for edge in graph.slice_edges:
        target_axis = assignment.class_axis.get(edge.target)
        source_axis = assignment.class_axis.get(edge.source)
        tensor = graph.tensors[edge.tensor]
        if target_axis is not None and source_axis != target_axis:
            if tensor.requires_grad:
                by_axis[target_axis] += local_bytes(tensor, assignment, sizes)
        elif edge.joined and source_axis is not None:
            by_axis[source_axis] += joined_moves(tensor) * local_bytes(
                tensor, assignment, sizes
            )
    for name, dims in assignment.fsdp.items():
        tensor = graph.param(name)
        if tensor.id in unread:
            continue  # nothing gathers it
        for _, axis in dims:
            by_axis[axis] += local_bytes(tensor, assignment, sizes)
    for exchange in table_exchanges(graph) if offers_table_exchanges(axes) else ():
        for axis, size in sizes.items():
            saving = exchange.saving_bytes(graph, size)
            if saving > 0 and table_exchange_applies(graph, exchange, assignment, axis):
                by_axis[axis] -= saving
    replicated = sum(f for _, f in repeated_products(graph, axes, assignment))
    # An axis spanning the mesh's is listed where it moves bytes.
    own = {a.name for a in mesh_axes(axes)}
    by_axis = {axis: moved for axis, moved in by_axis.items() if moved or axis in own}
    return PlanCost(
        parameter_bytes=int(param_bytes),
        gradient_bytes=int(grad_bytes),
        optimizer_bytes=int(opt_bytes),
        activation_bytes=int(activation_bytes),
        communication_bytes=sum(by_axis.values()),
        communication_by_axis=by_axis,
        replicated_flops=replicated,
    )


def repeated_products(
    graph: AxisGraph, axes: tuple[MeshAxis, ...], assignment: Assignment
) -> list[tuple[CommEvent, float]]:
    """Each forward matrix product that some mesh axis repeats on its
    devices instead of splitting, with the FLOPs per device it repeats (a
    product of F FLOPs none of whose dims an axis of size n cuts runs
    F (1 - 1/n) / devices more FLOPs per device than an even split).

    Args:
        graph: The model's axis graph.
        axes: Mesh axes of size > 1 (spanning ones included).
        assignment: The candidate.

    Returns:
        `(contraction event, repeated FLOPs per device)`, those > 0.
    """
    covers = {a.name: a.covers for a in axes}
    devices = math.prod(a.size for a in mesh_axes(axes))
    repeated = []
    for event in graph.comm_events:
        if event.kind != "contract" or event.phase != "forward":
            continue
        used = {
            name
            for axis in _axes_of(iteration_classes(graph, event), assignment)
            for name in covers[axis]
        }
        flops = contraction_flops(graph, event)
        extra = sum(
            flops * (1 - 1 / axis.size) / devices
            for axis in mesh_axes(axes)
            if axis.name not in used
        )
        if extra > 0:
            repeated.append((event, extra))
    return repeated


def joined_moves(tensor: TensorNode) -> float:
    """How often a part of a join cut like the join moves between devices
    (`SliceEdge.joined`): forward, and its gradient backward."""
    return 2.0 if tensor.requires_grad else 1.0


def _axes_of(classes, assignment: Assignment) -> list[str]:
    found = {assignment.class_axis.get(c) for c in classes}
    return sorted(a for a in found if a is not None)
