"""Where XLA's partitioner holds activations cut otherwise than the plan
computes them: a parameter's storage cut carried into the residual stream
and what the backward pass keeps, over an axis the plan computes it whole
on; a reshape's merged dims cut as its result is (`held_as_partitioned`,
read by `accelerator_peak.accelerator_peak`; `stream_drift` also by
`output_layouts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.batch_classes import batch_carrying_classes
from keras_autoshard.planner.cost_model import Assignment, local_bytes, tensor_axes
from keras_autoshard.planner.remat import layer_calls
from keras_autoshard.plans.mesh import entry_axes


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
    token_axes = _names(
        assignment.class_axis.get(c) for c in batch_carrying_classes(graph)
    )
    # A table read by a gather (or its cast, under mixed precision) is
    # gathered where it is read.
    cast_of = dict(graph.param_casts)
    looked_up = {
        cast_of.get(e.tensor, e.tensor)
        for e in graph.comm_events
        if "gather" in e.primitive.split("+")
    }
    classes: dict[int, str] = {}
    for tensor in graph.tensors:
        if tensor.kind != "param" or len(tensor.shape) < 2:
            continue
        if tensor.id in looked_up:
            continue
        for dim, axis in assignment.fsdp.get(tensor.name, ()):
            cls = tensor.dim_classes[dim]
            if cls is None or axis in token_axes:
                continue
            if assignment.class_axis.get(cls) is None:
                classes.setdefault(cls, axis)
    return classes


def drifted_classes(graph: AxisGraph, assignment: Assignment) -> dict[int, str]:
    """Axis class -> the mesh axis XLA's partitioner holds its activations
    cut over, where the plan computes the class whole: the storage cuts it
    does not gather (`kernel_drift`, `stream_drift`)."""
    return {
        **kernel_drift(graph, assignment),
        **stream_drift(graph, assignment).classes,
    }


def held_as_partitioned(
    graph: AxisGraph,
    assignment: Assignment,
    sizes: Mapping[str, int],
    reached: frozenset[int] = frozenset(),
) -> Assignment:
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
    A group of dims merged by a reshape into a dim the plan cuts is held cut
    with it (`merged_group_cuts`). A kernel stored cut on a dim the plan
    computes whole, over an axis that cuts no token dim, carries its cut
    too (`kernel_drift`), and into more than the stream: into every
    activation the backward pass keeps of a layer that is not
    rematerialized (`reached`). Read off the same 16x16
    program at 8 layers, the lower 4 rematerialized: XLA holds the upper
    layers' kept activations of the hidden class cut over `model`. A norm
    scale's cut reaches them too (at 11 layers, the lower 2
    rematerialized: both norms' outputs of every other layer are held a
    sixteenth as large, 32 MiB where counted whole they were 512 MiB,
    estimate over compiled 1.19); where a product the plan computes whole
    over that axis reads one, its gathered copy is kept as well
    (`gathered_by_stage`).
    The activations a rematerialized layer recomputes are held cut too
    (`reached`): the `scales_cut` Llama-2-70B plan on 16x16 at 3 layers,
    the lower 2 rematerialized, recomputes their norm outputs as
    `[512, 8, 4096]` (the hidden dim a sixteenth) and the zoo's subclassed
    model on 2x4 under 75 % of its free peak its LayerNorm outputs as
    `[32, 4, 64]` (`tests/planner/test_drift_copies_gpu.py`,
    `benchmarks/tests/test_peak_buffers.py`). Both gather whole copies
    for the products that read them; which of those copies are live at a
    rematerialized layer's peak is `gathered_by_stage`'s.

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding.
        sizes: Mesh axis name -> size.
        reached: Ids of the activations a storage cut's drift reaches
            beside the layers' inputs: those kept from the forward pass to
            the backward pass and those rematerialized layers recompute
            (not a parameter's cast: `accelerator_peak` counts those whole,
            as the gathered copies the products read; counted cut, the
            Llama-3.1-405B plan on 64x8 at 2 to 8 layers, every layer
            rematerialized, fell from 0.97 to 0.95 of its compiled peak).

    Returns:
        `assignment` with those activations' cuts added.
    """
    drifted = drifted_classes(graph, assignment)
    cuts = dict(assignment.activation_cuts)
    cuts.update(merged_group_cuts(graph, assignment, sizes))
    if not drifted:
        return dataclasses.replace(assignment, activation_cuts=cuts)
    reached = reached.union(t for _, ids in graph.layer_inputs for t in ids)
    for tensor in graph.tensors:
        if tensor.id not in reached:
            continue
        # The axes its dims take, those of a merged run's cut included.
        used = _names(tensor_axes(tensor, assignment))
        used.update(_names(axis for _, axis in cuts.get(tensor.id, ())))
        added = []
        for dim, cls in enumerate(tensor.dim_classes):
            axis = drifted.get(cls)
            if axis is not None and not _names([axis]) & used:
                added.append((dim, axis))
                used.update(_names([axis]))
        if added:
            cuts[tensor.id] = tuple(cuts.get(tensor.id, ())) + tuple(added)
    return dataclasses.replace(assignment, activation_cuts=cuts)


def gathered_by_stage(
    graph: AxisGraph,
    assignment: Assignment,
    held: Assignment,
    sizes: Mapping[str, int],
    remat: frozenset[str],
    kept: frozenset[int],
    recomputed: frozenset[int] = frozenset(),
    peak_tensors: Mapping[str, int] | None = None,
) -> list[float]:
    """Gathered copies of activations held cut that a device holds at each
    stage of the backward pass (`remat.accelerator_stages` order).

    An activation held cut over an axis the plan computes it whole on
    (`held_as_partitioned`: a storage cut's drift) is gathered over that
    axis for the matrix products that need it whole, and XLA:GPU forms the
    weight gradients of a layer that is not rematerialized at the end of
    the backward pass, from gathered copies held until then:
    - a kept input a norm scale's cut holds cut (`stream_drift`), read by
      a product computed whole over the axis (its output has no dim on it:
      grouped key and value projections whose few heads the axis does not
      divide): the forward pass's gathered copy, held from the forward
      pass. Where a kernel's cut holds it cut (`kernel_drift`) the copy is
      not held: Llama-2-70B widths on 16x16 with the key kernel stored cut
      over `model` on its hidden dim gather the norm outputs for the query
      and feed-forward products and free them after the forward pass (12
      layers, 9 kept: estimate over compiled 1.14 with one held per kept
      layer, 1.02 without);
    - a kept input read by products computed cut over the axis: one copy
      gathered in the layer's backward pass, shared by those products;
    - a product's output whose class the axis holds cut (a row-parallel
      projection back to the hidden dim): its gradient, gathered.
    Read off XLA:GPU's programs of a Llama at Llama-2-70B widths on 16x16
    with the lower 2 layers rematerialized: at 5 layers each upper layer
    holds five such 512 MiB copies (the attention norm's output twice, the
    feed-forward norm's, the attention and feed-forward outputs'
    gradients) while the rematerialized layers' backward passes run (the
    peak; the estimate was 0.75 of it at 3 layers); at 11 layers, where the
    top layer's backward pass peaks, the forward copies.

    A rematerialized layer recomputes its activations held cut as well
    (`recomputed`) and gathers the same copies, from its recomputation
    (the forward copies) or its own backward pass (the others), and forms
    its weight gradients at the end of that backward pass, inside its
    optimization barrier: they are held at its own stage only. Its peak is
    where the gradient of its largest activation is formed
    (`peak_tensors`); the copies for products that read only later
    activations, whose backward passes ran before it, are held there, the
    others are not yet gathered or already freed. Read off XLA:GPU's
    programs: the `scales_cut` Llama-2-70B plan on 16x16 at 3 layers, the
    lower 2 rematerialized, peaks in the lowest layer's attention, holding
    copies of the feed-forward norm's output and of the feed-forward and
    attention outputs' gradients, and of the attention norm's output for
    the grouped key and value products (its recomputation's), 512 MiB
    each; the estimate was 0.92 of that peak with the recomputed norm
    outputs counted whole and no copy, 0.84 counted cut, 0.95 with the
    copies. The zoo's subclassed model on 2x4 under 75 % of its free peak
    peaks in its feed-forward products' gradients, its last: each forward
    copy is freed after its product and those for the weight gradients
    are gathered after the peak (`benchmarks/tests/test_peak_buffers.py`;
    1.15 of the compiled peak counted whole, 1.07 cut). Not followed: a
    peak elsewhere in the layer than at its largest activation's gradient.

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding, as the plan computes it.
        held: The same as XLA holds it (`held_as_partitioned` of `kept`
            and `recomputed`).
        sizes: Mesh axis name -> size.
        remat: Names of the rematerialized layer calls.
        kept: Ids of the activations kept from the forward pass to the
            backward pass.
        recomputed: Ids of the activations the rematerialized layers make
            again in their backward passes.
        peak_tensors: Rematerialized layer name -> the id of the activation
            whose gradient's buffers are its stage's largest (absent: every
            copy of the layer counted).

    Returns:
        Bytes per device at each stage (one entry per stage).
    """
    order = layer_calls(graph)
    streamed = stream_drift(graph, assignment).classes  # a norm scale's
    drifted = {**kernel_drift(graph, assignment), **streamed}
    if not drifted:  # nothing held cut, nothing gathered
        return [0.0] * (len(order) + 1)
    position = {layer: i for i, layer in enumerate(order)}
    params = {t.id for t in graph.tensors if t.kind == "param"}
    params.update(cast for cast, _ in graph.param_casts)
    peak_tensors = peak_tensors or {}
    forward = 0.0
    late = [0.0] * (len(order) + 1)
    own = [0.0] * (len(order) + 1)  # a rematerialized layer's, at its stage
    counted: set[tuple[str, int, str]] = set()

    def add(layer: str, tid: int, copy: str) -> None:
        nonlocal forward
        if (layer, tid, copy) in counted:
            return
        counted.add((layer, tid, copy))
        size = local_bytes(graph.tensors[tid], assignment, sizes)
        if layer in remat:
            own[position.get(layer, len(order))] += size
        elif copy == "forward":
            forward += size
        else:
            late[position.get(layer, len(order))] += size

    for out, lhs, rhs, _ in graph.products:
        layer = graph.tensor_layers[out]
        if not {lhs, rhs} & params:
            continue
        operands = {lhs, rhs} - params
        made = recomputed if layer in remat else kept
        # Its backward pass ran before the layer's peak: it reads only
        # activations made after the one whose gradient peaks there.
        peak = peak_tensors.get(layer)
        done = layer not in remat or peak is None or all(o > peak for o in operands)
        out_axes = _names(tensor_axes(graph.tensors[out], assignment))
        for operand in operands:
            axes = _names(a for _, a in held.activation_cuts.get(operand, ()))
            cut = axes - _names(tensor_axes(graph.tensors[operand], assignment))
            if operand not in made or not cut:
                continue
            classes = graph.tensors[operand].dim_classes
            if cut & out_axes:
                if done:
                    add(layer, operand, "backward")
            elif _names(streamed.get(c) for c in classes) & cut:
                add(layer, operand, "forward")
        # An activation's gradient (a product of weights alone makes none).
        classes = graph.tensors[out].dim_classes
        drift = _names(drifted[c] for c in classes if c in drifted) - out_axes
        if operands and done and drift:
            add(layer, out, "gradient")
    stages = []
    running = forward
    for i in reversed(range(len(late))):  # a layer's own from the one below
        stages.append(running + own[i])
        running += late[i]
    return stages[::-1]


def merged_group_cuts(
    graph: AxisGraph, assignment: Assignment, sizes: Mapping[str, int]
) -> dict[int, tuple[tuple[int, str], ...]]:
    """Activations cut as the reshape that merges their dims is.

    A reshape that merges a run of dims into one (grouped key/value heads
    repeated and merged into the query heads: `(kv, repeat) -> heads`) lets
    the plan cut the merged dim on an axis where the run's major dim stays
    whole (`SliceEdge`): 8 key/value heads cannot be cut 16 ways, their 64
    query heads can. XLA's partitioner holds the operand cut as its result
    is: the run's elements over the axis's devices, factored across its
    dims (8 ways over the key/value heads, 2 over the repeats). Read off
    XLA:GPU's program of a Llama at Llama-2-70B widths on 16x16, 4 layers:
    each layer keeps its repeated keys and values as 32 MiB buffers, where
    counted whole they were 512 MiB each (estimate over compiled 1.19).
    Counted here as a cut of the run's major dim: its bytes are the run's
    divided by the axis's size, which divides the run's elements.

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding.
        sizes: Mesh axis name -> size.

    Returns:
        Tensor id -> the cuts to add (`Assignment.activation_cuts`).
    """
    merged_into: dict[int, set[int]] = {}
    for edge in graph.slice_edges:
        merged_into.setdefault(edge.source, set()).add(edge.target)
    cuts: dict[int, tuple[tuple[int, str], ...]] = {}
    for tensor in graph.tensors:
        if tensor.kind != "activation":
            continue
        axes = tensor_axes(tensor, assignment)
        added: list[tuple[int, str]] = []
        for dim, cls in enumerate(tensor.dim_classes):
            if axes[dim] is not None or cls not in merged_into:
                continue
            for target in merged_into[cls]:
                axis = assignment.class_axis.get(target)
                taken = _names([*axes, *dict(added).values()])
                if axis is None or _names([axis]) & taken:
                    continue
                run = _run_of(tensor.shape, dim, graph.classes[target].size)
                if run is not None and run % sizes[axis] == 0:
                    added.append((dim, axis))
                    break
        if added:
            cuts[tensor.id] = tuple(assignment.activation_cuts.get(tensor.id, ())) + (
                tuple(added)
            )
    return cuts


def _run_of(shape: tuple[int, ...], dim: int, merged: int) -> int | None:
    """The elements of the dims from `dim` on whose product is `merged` (a
    reshape's merged run), or None."""
    product = 1
    for size in shape[dim:]:
        product *= size
        if product == merged:
            return product
        if product > merged:
            return None
    return None


def _names(axes) -> set[str]:
    """The mesh axes cutting dims over `axes` (names, `None`s, and axes
    spanning several mesh axes, `"batch+model"`) use."""
    return {name for axis in axes for name in entry_axes(axis)}
