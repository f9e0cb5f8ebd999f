"""What one device holds at the peak of a step, under a candidate sharding.

Pure functions of the axis graph and an `Assignment`. For a training step
(the jitted `train_step` Keras runs, state donated):

- parameters: every variable's local shard (trainable and not);
- gradients: one per trainable parameter the step reads, cut like it (an
  unread one's is zero, folded by XLA);
- optimizer: `optimizer_slots` copies per trainable parameter;
- activations: what the backward pass keeps (the graph's residuals, read
  from JAX's derivative rules per equation), each cut like its tensor, and
  the all-gathered copies of FSDP-cut weights it keeps
  (`remat.gathered_param_terms`);
- data: this device's inputs, and its targets (one per output, laid out by
  batch only, as Keras distributes the data; float32 where the output is a
  half float: `TARGET_ITEMSIZE`);
- transient: what the fullest phase of the step holds besides: in the
  backward pass the loss's gradient (the output's size) and the largest
  backward workspace, three times the largest activation of the batch that
  is not an output (a layer's output gradient, its input gradient and that
  gradient's all-reduced copy live at once); at the loss, the outputs and
  their gradient (no parameter gradient exists yet); a pooling's index
  buffers (`workspaces`, made in the forward pass); under gradient
  accumulation, the update's new copy of every trainable variable, its
  slots and accumulator. The gradients counted are the fullest phase's.

That is XLA:CPU's program (`platform="cpu"`: simulated devices). For an
accelerator's (`"gpu"`, `"tpu"`: a GPU hardware profile, or the devices
planned on), the activations are kept as XLA:GPU fuses them
(`AxisGraph.for_platform`), and the backward pass is a sequence of stages,
one per layer in reverse call order (`accelerator_peak.py`): each holds what
the layers not yet differentiated keep, the current layer's own residuals,
the gradients finished so far (held to the updates, after the backward
pass) and one buffer of its largest batch activation; under gradient
accumulation the update, after the backward pass, writes every trainable
variable and its slots anew beside the old, the gradients and their
all-reduce's operand (on one device the new copies alone, and a copy of
the accumulators through the backward pass).

For inference (`predict`), the parameters, the data, the predictions (the
outputs it returns) and twice the largest activation of the batch (a
layer's input and output), or once the largest made from weights alone (a
gathered, transposed table), whichever is more; on XLA:CPU, every weight
it copies into another layout for a matrix product besides
(`cost_model.relaid_weights`: its default schedule makes them all first,
live together). Generation
(`generate`) counts the same but the predictions (only tokens are
returned), plus the key/value cache: the key and the value of every
attention (`AxisGraph.key_values`, found by graph shape in
`graph/kv_cache.py`) at the traced sequence length, cut like them.
Everything is bytes per device; `peak_bytes` is the sum.
"""

from __future__ import annotations

import math

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.accelerator_peak import accelerator_peak
from keras_autoshard.planner.batch_classes import batch_carrying_classes
from keras_autoshard.planner.cost_model import (
    Assignment,
    gathered_bytes,
    kept_bytes,
    local_bytes,
    relaid_weights,
    tensor_axes,
    terms_bytes,
    widening,
)
from keras_autoshard.planner.gradient_reduction import (
    COMBINE_THRESHOLD_BYTES,
    gathered_weight_bytes,
    reduced_partials,
)
from keras_autoshard.planner.mesh_axis import MeshAxis
from keras_autoshard.planner.remat import (
    backward_stages,
)
from keras_autoshard.plans.estimate import COMPILERS, PlanEstimate

JOBS = ("train", "inference", "generate")


def estimate_memory(
    graph: AxisGraph,
    axes: tuple[MeshAxis, ...],
    assignment: Assignment,
    optimizer_slots: int = 2,
    job: str = "train",
    half_as_single: bool = False,
    remat: frozenset[str] = frozenset(),
    micro_batches: int = 1,
    platform: str = "cpu",
) -> PlanEstimate:
    """Per-device bytes at the peak of a step (see the module docstring).

    Args:
        graph: The model's axis graph.
        axes: Mesh axes of size > 1.
        assignment: The candidate sharding.
        optimizer_slots: Optimizer state per trainable parameter, in copies.
        job: `"train"`, `"inference"` or `"generate"`.
        half_as_single: Count 2-byte work buffers, and 2-byte residuals
            that matrix products read, at 4 bytes (XLA:CPU runs
            half-precision arithmetic in float32; accelerators do not; see
            `cost_model.widening` and `cost_model.kept_widening`).
        remat: Names of the layer calls rematerialized (`graph/blocks.py`)
            (`planner/remat.py`).
        micro_batches: Gradient accumulation: the batch is fed in this many
            parts, one per step (what the batch makes shrinks by it; each
            trainable variable gains an accumulator).
        platform: `"cpu"` (XLA:CPU's program), `"gpu"` or `"tpu"` (an
            accelerator's: `accelerator_peak`); `graph` must be
            `graph.for_platform(platform)`.

    Returns:
        A `PlanEstimate` with its byte fields set (communication, budget
        and step time are the planner's to add).
    """
    if job not in JOBS:
        raise ValueError(f"job={job!r}: use one of {JOBS}.")
    sizes = {a.name: a.size for a in axes}
    parameters = trainable = gradients = 0.0
    unread = set(graph.unread)
    for tensor in graph.tensors:
        if tensor.kind in ("param", "state"):
            shard = local_bytes(tensor, assignment, sizes)
            parameters += shard
            if tensor.kind == "param":
                trainable += shard
                if tensor.id not in unread:
                    gradients += shard
    # Data arrive cut by the batch axis only (`_data_bytes`).
    data_ways = sizes.get(batch_axis(graph, assignment), 1)
    inputs = _data_bytes(
        graph, data_ways, [t.id for t in graph.tensors if t.kind == "input"]
    )
    output_ids = set(graph.outputs)
    batch_classes = batch_carrying_classes(graph)
    # A parameter's view (a tied table's transpose) that a matrix product
    # reads where the parameter is stored: no buffer of its own (measured:
    # the tied model on 1x8 with its table whole compiled its forward step
    # at 0.92 MB, estimated at 1.38 MB counting the transpose; stored cut
    # over 8x1 the table is gathered whole, a buffer, and counted).
    in_place = {
        view
        for view, param in graph.param_views
        if graph.tensors[param].name not in assignment.fsdp
    }
    largest = largest_derived = 0.0
    for t in graph.tensors:
        if t.kind != "activation" or t.id in output_ids:
            continue
        size = local_bytes(t, assignment, sizes) * widening(t, half_as_single)
        if batch_classes.intersection(t.dim_classes):
            largest = max(largest, size)
        elif t.id not in in_place:
            # Made from weights alone (a transposed table gathered whole):
            # its gradient.
            largest_derived = max(largest_derived, size)
    if job != "train":
        cache = cache_bytes(graph, assignment, sizes) if job == "generate" else 0
        # `predict` returns every output; generation keeps only its tokens
        # (the prompt's outputs are not returned, so XLA drops them).
        predictions = (
            terms_bytes(
                graph,
                [(t, 1.0) for t in graph.outputs],
                assignment,
                sizes,
                half_as_single,
            )
            if job == "inference"
            else 0.0
        )
        # XLA:CPU's default schedule makes every weight's relayout first.
        relaid = sum(
            local_bytes(t, assignment, sizes, include_fsdp=False)
            * widening(t, half_as_single)
            for t in (relaid_weights(graph) if platform == "cpu" else ())
        )
        return PlanEstimate(
            parameter_bytes=int(parameters),
            gradient_bytes=0,
            optimizer_bytes=0,
            activation_bytes=0,
            data_bytes=int(inputs),
            transient_bytes=int(
                max(2 * largest, largest_derived) + relaid + predictions
            ),
            cache_bytes=int(cache),
            job=job,
            compiler=COMPILERS[platform],
        )
    # One target per differentiable output, at `TARGET_ITEMSIZE` where the
    # output is a narrower float.
    outputs = [t for t in graph.outputs if graph.tensors[t].requires_grad]
    targets = _data_bytes(graph, data_ways, outputs, TARGET_ITEMSIZE)
    workspace = max(
        (
            local_bytes(graph.tensors[t], assignment, sizes)
            * f
            * widening(graph.tensors[t], half_as_single)
            for t, f in graph.workspaces
        ),
        default=0.0,
    )
    outputs = terms_bytes(
        graph,
        [(t, 1.0) for t in graph.outputs if graph.tensors[t].requires_grad],
        assignment,
        sizes,
        half_as_single,
    )
    accumulators = trainable if micro_batches > 1 else 0.0
    if platform != "cpu":
        # Accumulating, Keras applies the optimizer in a conditional that
        # XLA:GPU makes a select across devices: every trainable variable
        # and its slots written anew beside the old; on one device it keeps
        # the conditional and copies the accumulators (`accelerator_peak`).
        updated = trainable * (1 + optimizer_slots) if micro_batches > 1 else 0.0
        kept, gradients, transient = accelerator_peak(
            graph, assignment, sizes, remat, micro_batches, updated, accumulators
        )
        return PlanEstimate(
            parameter_bytes=int(parameters),
            gradient_bytes=int(gradients),
            optimizer_bytes=int(optimizer_slots * trainable + accumulators),
            activation_bytes=int(
                kept + gathered_bytes(graph, assignment, sizes, remat)
            ),
            data_bytes=int((inputs + targets) / micro_batches),
            transient_bytes=int(max(transient, 2 * outputs / micro_batches)),
            compiler=COMPILERS[platform],
        )
    if remat:
        kept, gradients = _staged_peak(
            graph, assignment, sizes, half_as_single, remat, micro_batches
        )
    else:
        kept = kept_bytes(graph, assignment, sizes, half_as_single, remat)
    gathered = gathered_bytes(graph, assignment, sizes, remat)
    part = 1.0 / micro_batches
    # The fullest of the step's phases, the first three with every kept
    # activation:
    # the backward pass (the gradients, the loss's gradient, which takes the
    # output's cut, and a layer's backward workspace: its output gradient,
    # input gradient and that one's all-reduced copy); the loss (the
    # outputs and their gradient, no parameter gradient yet); a pooling's
    # workspace, which XLA:CPU makes in the forward pass (index buffers to
    # select the maxima by); and with gradient accumulation the update:
    # Keras applies the optimizer inside a conditional (apply or
    # accumulate), whose results (every trainable variable, its slots and
    # its accumulator) XLA writes to new buffers beside the old. Measured
    # on XLA:CPU scheduling for memory: the loss's two buffers counted
    # beside the backward workspace put the zoo's tied model
    # (a vocabulary-sized output) at 1.18 of the compiled peak, the
    # gradients beside a pooling's workspace the CNN at 1.17 (1x8), and
    # without the update a Llama accumulating 4 micro-batches at 0.75.
    held = kept * part + gathered
    partials, reduced = reduced_partials(graph, assignment, sizes)
    phases = [
        (gradients, held, outputs * part + max(3 * largest * part, largest_derived)),
        (0.0, held, 2 * outputs * part),
        (0.0, held, workspace * part),
        # The gradients' combined reduction over the batch, after the
        # backward pass: every partial gradient it reduces beside its result.
        (gradients, 0.0, partials + min(partials, COMBINE_THRESHOLD_BYTES) - reduced),
        # The first layers' gradients, formed once the activations are
        # freed: a weight stored cut gathered beside its whole gradient.
        (gradients, 0.0, gathered_weight_bytes(graph, assignment, sizes, remat)),
    ]
    if micro_batches > 1:
        # After the backward pass: its activations are freed.
        phases.append((0.0, 0.0, trainable * (2 + optimizer_slots)))
    gradients, held, transient = max(phases, key=sum)
    return PlanEstimate(
        parameter_bytes=int(parameters),
        gradient_bytes=int(gradients),
        optimizer_bytes=int(optimizer_slots * trainable + accumulators),
        activation_bytes=int(held),
        data_bytes=int((inputs + targets) * part),
        transient_bytes=int(transient),
    )


def cache_bytes(
    graph: AxisGraph, assignment: Assignment, sizes: dict[str, int]
) -> float:
    """Bytes of the key/value cache on one device: every attention's key
    and value (`AxisGraph.key_values`), cut like them.

    A dim left whole that is repeated into a cut one (grouped key/value
    heads repeated to the query heads, a "repeat" `SliceEdge`) is held only
    as far as this device's part of the repeat reads it: 2 key/value heads
    repeated to query heads cut 4 ways leave 1 head per device (measured:
    XLA:CPU keeps a Llama cache of 2 heads at 1 per device on a 4-way
    axis); a size the cut does not divide is counted by their common
    factor.

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding.
        sizes: Mesh axis name -> size.

    Returns:
        Bytes per device.
    """
    repeats = [e for e in graph.slice_edges if e.reason == "repeat"]
    repeated_to = {edge.source: edge.target for edge in repeats}
    total = 0.0
    for pair in graph.key_values:
        for tid in pair:
            tensor = graph.tensors[tid]
            held = local_bytes(tensor, assignment, sizes)
            axes = tensor_axes(tensor, assignment)
            for size, class_id, axis in zip(tensor.shape, tensor.dim_classes, axes):
                target_axis = assignment.class_axis.get(repeated_to.get(class_id))
                if axis is None and target_axis is not None:
                    held /= math.gcd(size, sizes[target_axis])
            total += held
    return total


def _staged_peak(
    graph: AxisGraph,
    assignment: Assignment,
    sizes: dict[str, int],
    half_as_single: bool,
    remat: frozenset[str],
    micro_batches: int,
) -> tuple[float, float]:
    """(activations, gradients) one device holds at the fullest stage of a
    backward pass with `remat` rematerialized (`remat.backward_stages`):
    a schedule for memory, which rematerialization needs to pay off,
    differentiates layer by layer, so a layer's recomputed residuals meet
    only the gradients made before it (measured on XLA:CPU scheduling for
    memory: every gradient counted with them overestimated the zoo's
    KerasHub layers by up to a fifth)."""
    part = 1.0 / micro_batches
    held, stages = backward_stages(graph, remat)
    always = graph.other_residual_bytes + terms_bytes(
        graph, held, assignment, sizes, half_as_single, kept=True
    )
    shard = {
        tid: local_bytes(graph.tensors[tid], assignment, sizes)
        for tid, _ in graph.param_readers
    }
    best = (-1.0, 0.0, 0.0)
    for stage in stages:
        kept = always + terms_bytes(
            graph, stage.recomputed, assignment, sizes, half_as_single, kept=True
        )
        gradients = sum(shard[tid] for tid in stage.gradients)
        best = max(best, (kept * part + gradients, kept, gradients))
    return best[1], best[2]


# Bytes per element of a floating target as the step receives it: Keras's
# data adapters hand float data over as `floatx` (float32), and the loss
# casts it; under `mixed_bfloat16` a bfloat16 output's target is still
# float32. Measured: one Dense layer under `mixed_bfloat16`, 8x1 for 8 H100s
# (tests/planner/test_held_gradients_gpu.py), estimated 2.69 MiB against 3.16
# compiled while the target counted as bfloat16; the 1 MiB float32 target
# on each device was the 0.47 MiB missing.
TARGET_ITEMSIZE = 4


def batch_axis(graph: AxisGraph, assignment: Assignment) -> str | None:
    """The mesh axis that cuts the batch of the model's inputs (Keras's data
    layout: `ShardingPlan.batch_axis`), or `None` where none does."""
    for tensor in graph.tensors:
        if tensor.kind == "input" and tensor.dim_classes:
            cls = tensor.dim_classes[0]
            if cls is not None and cls in assignment.class_axis:
                return assignment.class_axis[cls]
    return None


def _data_bytes(
    graph: AxisGraph,
    ways: int,
    tensor_ids,
    least_itemsize: int = 1,
) -> float:
    """Bytes on one device of data the step is given (inputs, targets): cut
    `ways` ways, by the batch axis only (`batch_axis`), as Keras lays data
    out, whatever the plan cuts the batch by inside the step. Measured on
    XLA:GPU: an MLP whose plan cuts its inputs' batch 8 ways on a 2x4 mesh
    is given them cut 2 ways (128 MiB a device, where the plan's cut said
    32)."""
    return sum(
        math.prod(graph.tensors[t].shape)
        * max(graph.tensors[t].itemsize, least_itemsize)
        / ways
        for t in tensor_ids
    )
