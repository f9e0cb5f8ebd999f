"""What one device holds at the fullest stage of an accelerator's backward
pass (XLA:GPU's program), under a candidate sharding.

`memory_model.estimate_memory` counts a training step planned for an
accelerator with `accelerator_peak`; XLA:CPU's program (simulated devices)
is counted there, by `memory_model._staged_peak` and the phases beside it.
"""

from __future__ import annotations

import dataclasses
import math

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.batch_classes import batch_carrying_classes
from keras_autoshard.planner.cost_model import (
    Assignment,
    local_bytes,
    tensor_axes,
)
from keras_autoshard.planner.gradient_reduction import (
    COMBINE_THRESHOLD_BYTES,
    reduce_scattered,
)
from keras_autoshard.planner.loss_reduction import (
    loss_combined_reductions,
    loss_made_tensors,
)
from keras_autoshard.planner.remat import accelerator_stages, layer_calls
from keras_autoshard.planner.split_k import (
    activation_products,
    gradient_buffers,
    kept_partials_factors,
    merged_split_gradient_bytes,
    norm_read_partials_factors,
    partials_made_by,
    split_sums_of_several_products,
)
from keras_autoshard.planner.stream_drift import gathered_by_stage, held_as_partitioned


def accelerator_peak(
    graph: AxisGraph,
    assignment: Assignment,
    sizes: dict[str, int],
    remat: frozenset[str],
    micro_batches: int = 1,
    updated_bytes: float = 0.0,
    accumulated_bytes: float = 0.0,
) -> tuple[float, float, float]:
    """(activations, gradients, workspace) one device holds at the fullest
    stage of an accelerator's backward pass (`remat.accelerator_stages`).

    XLA:GPU differentiates layer by layer in reverse call order and frees a
    kept activation after the backward pass of the last layer that reads
    it; the updates run after the whole backward pass (Keras applies the
    optimizer to all gradients at once), so every finished gradient is held
    to the end. A stage holds: every kept activation some layer not yet
    differentiated reads (a rematerialized layer keeps only its input), the
    current layer's own residuals (made again when it is rematerialized,
    held cut where a storage cut's drift reaches them as it does the kept
    ones, `stream_drift.held_as_partitioned`; a split product's partials
    where XLA:GPU keeps them in its output's place,
    `split_k.kept_partials_factors`; gathered copies of what the drift
    holds cut, `stream_drift.gathered_by_stage`, a rematerialized layer's
    those held where its largest activation's gradient is formed), the
    gradients of every parameter read by it or a layer above (in its
    cast's precision where the batch reduces, `AxisGraph.narrowed_params`,
    unless its layer is rematerialized: its optimization barrier widens
    them),
    and a workspace: the larger of two. One is the gradient being formed,
    one buffer of the layer's largest batch activation, or, for an
    activation several products read, each product's input gradient (in
    its partials where XLA:GPU splits it, `split_k.input_gradient_partials`)
    beside their sum, with the partial products of the layer's weight
    gradients XLA:GPU splits over the tokens
    (`split_k.merged_split_gradient_bytes`: products reading one input merged,
    one merged product's at a time, each summed as made; none at real widths;
    where no batch axis reduces them, the optimizer's update sums them, and
    the lowest layer's stage holds the next layer's beside its own:
    `_update_read_partials`);
    where a product of a later layer makes an activation's gradient in
    split partials, that layer's backward pass holds them and their sum
    instead (`split_k.partials_made_by`); and at a head's stage the loss's
    float32 gradient of the head's output beside either. Where that
    largest buffer is the split input gradient of an activation several
    products read, the layer's own weight gradients are not yet made
    (`split_k.split_sums_of_several_products`), unless it is
    rematerialized. The other is the largest combined reduction of the
    gradients over the batch axes so far (its concatenated operand beside
    its result; XLA packs them in the order they are made, up to
    `COMBINE_THRESHOLD_BYTES` and never across a rematerialized layer's
    barrier: a stack of
    six 1024-wide Dense layers on 2x4 peaks with all its gradients twice,
    6.3 MB each, as the combined all-reduce's operand and result; six
    4096-wide ones, 16 MiB per kernel, combine one layer's each), which
    runs apart from the layer's products (the zoo's Gemma on 8x1 peaks in
    its combined reduction of every gradient, with no product's buffers
    live).
    Read off XLA:GPU's buffers at the compiled peak: a Llama at Llama-2-70B
    widths on 32x8, every layer rematerialized, peaks at the top layer (the
    layer inputs, its recomputed residuals, no gradient yet); at Llama-3-8B
    widths without rematerialization at the top layer too (the lower
    layers' residuals, its own, its weight gradients and attention-sized
    buffers); Mixtral-8x7B on 8x8 at the bottom layer (every layer's
    float32 expert kernel gradients, 224 MiB each, live from their backward
    pass to the updates after it, and the upper layers' inputs freed): per
    layer its compiled peak grows by the layer's parameters, optimizer
    slots and gradients (2.08 GB), which counting only the top layer's
    gradients put at 1.83 GB.

    Args:
        graph: The model's axis graph, `for_platform` an accelerator.
        assignment: The candidate sharding.
        sizes: Mesh axis name -> size.
        remat: Names of the rematerialized layer calls.
        micro_batches: Gradient accumulation parts.
        updated_bytes: Under gradient accumulation, what the update writes
            anew beside the old state (every trainable variable and its
            slots: Keras applies the optimizer in a conditional, which
            XLA:GPU makes straight-line code across devices). The update
            runs after the backward pass, the activations freed, beside
            every gradient and the operand of their combined all-reduce
            (those stored cut over the batch are reduce-scattered in the
            backward pass: their shards alone). A stack of three 512-wide MLPs on 2x4
            accumulating 4 micro-batches peaks there, 1.00 of its compiled
            peak; 0.78 counted without the gradients and the operand, 0.67
            without the update (`tests/planner/test_accumulation_update_gpu.py`).
            On one device XLA:GPU keeps the conditional instead: its update
            reads each gradient as the backward pass makes it, so only the
            new copies are held at the end; the same stack on one H100
            peaks with them alone (the gradients counted too, 1.11 of its
            compiled peak).
        accumulated_bytes: Under gradient accumulation, the accumulators'
            bytes. On one device XLA:GPU copies the accumulators that
            conditional reads in the forward pass and holds the copies to
            it, through the backward pass: the same stack on one H100 holds
            20 of its 24 MiB of accumulators so from its forward pass to the
            update (0.93 of its compiled peak counted without them, 1.00
            with them); a 1.24 B Llama accumulating 4 micro-batches on one
            H200 measured 43.93 GiB against 40.23 GiB estimated without
            them, and with them 39.07 against 39.80 GiB (its plan 14 layers
            rematerialized, was 13) and at twice the batch 46.50 against
            46.28 GiB (`benchmarks/device_step.py`). Across devices the
            conditional is straight-line code, which copies none.

    Returns:
        Bytes per device of the fullest stage: kept activations (the
        current layer's included), gradients, workspace.
    """
    part = 1.0 / micro_batches
    stages = accelerator_stages(graph, remat)
    last = len(stages) - 1
    calls = layer_calls(graph)
    position = {layer: i for i, layer in enumerate(calls)}
    kept = frozenset(tid for stage in stages for tid, _ in stage.kept_to_here)
    own = frozenset(tid for stage in stages for tid, _ in stage.own)
    # What rematerialized layers make again, a parameter's cast aside (its
    # gathered copy is what the products read, counted whole).
    recomputed = own.difference(cast for cast, _ in graph.param_casts)
    planned = assignment
    assignment = held_as_partitioned(graph, planned, sizes, kept | recomputed)

    # Products whose split partial results are kept in their output's place,
    # and activations whose gradient a product makes in split partials.
    whole = dataclasses.replace(assignment, fsdp={})
    residuals = kept | own
    products = activation_products(graph, whole, sizes)
    partials_kept = kept_partials_factors(graph, products, residuals)
    for tid, factor in norm_read_partials_factors(
        graph, products, whole, sizes, residuals
    ).items():
        partials_kept.setdefault(tid, factor)
    gradient_buffers_of = gradient_buffers(graph, products)
    partials_makers = partials_made_by(graph, products)

    def held(terms) -> float:
        # A value whose partials are kept is held as them alone: what else
        # the backward pass reads of it (a ReLU's mask) is computed again
        # from them (the zoo's subclassed model on 2x4: its ReLU Dense keeps
        # four float32 partials and no mask).
        per_tensor: dict[int, float] = {}
        for tid, factor in terms:
            if tid in partials_kept:
                per_tensor[tid] = partials_kept[tid]
            else:
                per_tensor[tid] = per_tensor.get(tid, 0.0) + factor
        return part * sum(
            local_bytes(graph.tensors[tid], assignment, sizes) * factor
            for tid, factor in per_tensor.items()
        )

    batch_classes = batch_carrying_classes(graph)
    loss_made = loss_made_tensors(graph)
    largest = [0.0] * len(stages)
    largest_of: dict[int, int] = {}  # stage -> the tensor its largest is for
    formed = [0.0] * len(stages)  # gradients made in partials for a layer below
    for tensor in graph.tensors:
        if tensor.kind != "activation" or tensor.id in loss_made:
            continue
        if not batch_classes.intersection(tensor.dim_classes):
            continue
        stage = position.get(graph.tensor_layers[tensor.id], last)
        size = local_bytes(tensor, assignment, sizes) * part
        # One buffer for the gradient being formed (two were counted for
        # every activation once, which put Llama-2-70B widths on 32x8 at
        # 1.16 of the compiled peak); where an MLP's activation is the
        # largest, the backward pass of the activation holds the gradients
        # of its output and its input at once, the second not counted
        # (`tests/planner/test_residual_fusion_gpu.py`); a precision cast's two
        # are, below. Several products' input gradients beside their sum,
        # or split partials, are (`split_k.gradient_buffers`).
        buffers = gradient_buffers_of.get(tensor.id, 1)
        # Split partials a later layer's product makes of this activation's
        # gradient are made and summed in that layer's backward pass, before
        # it forms its weight gradient's partials, not beside them: the zoo
        # MLP on 2x4 (`tests/planner/test_backward_buffers_gpu.py`) sums four
        # partials of its GELU output's gradient, then splits the down
        # projection's kernel gradient (1.11 of the compiled peak counted at
        # the GELU's layer beside its own kernel's partials).
        makers = partials_makers.get(tensor.id, ())
        reader = max(
            (position.get(graph.tensor_layers[o], last) for o in makers), default=stage
        )
        if reader != stage:
            formed[reader] = max(formed[reader], size * buffers)
            buffers = 1
        _grow(largest, largest_of, stage, size * buffers, tensor.id)
    # The backward pass of a precision cast reads the cast's gradient and
    # writes its source's, buffers of two sizes live at once (Llama-2-70B
    # widths on 32x8: the bfloat16 attention probabilities' gradient, 2 GiB,
    # beside the float32 scores', 4 GiB, in every layer's backward pass).
    for cast, source in graph.activation_casts:
        if not batch_classes.intersection(graph.tensors[cast].dim_classes):
            continue
        stage = position.get(graph.tensor_layers[cast], last)
        pair = sum(
            local_bytes(graph.tensors[t], assignment, sizes) for t in (cast, source)
        )
        _grow(largest, largest_of, stage, pair * part, cast)
    # A max pooling's backward pass reads its output's gradient and the
    # positions of each window's maximum (one int32 array of the output's
    # shape per operand dim, made late: `graph/fusion._pooling_indices`)
    # and scatters the gradient into a zeroed buffer of its operand's size,
    # the operand's gradient.
    for source, output in graph.poolings:
        stage = position.get(graph.tensor_layers[output], last)
        operand, pooled = graph.tensors[source], graph.tensors[output]
        pooled_bytes = local_bytes(pooled, assignment, sizes)
        positions = pooled_bytes / pooled.itemsize * 4 * len(operand.shape)
        scatter = local_bytes(operand, assignment, sizes)
        scattering = (scatter + pooled_bytes + positions) * part
        _grow(largest, largest_of, stage, scattering, output)
    # The loss's gradient of an output a product makes (a head), which the
    # loss writes in float32 and the head's backward pass reads into both
    # its input's and its weight's gradient products, is live through that
    # layer's backward pass (the zoo's tied model on 2x4: its logits'
    # gradient, 256 KiB per device, beside the projection's partials).
    loss_gradient = [0.0] * len(stages)
    product_made = {out for out, *_ in graph.products}
    product_made.update(t for _, images, _ in graph.fused_products for t in images)
    for tid in product_made.intersection(graph.outputs):
        tensor = graph.tensors[tid]
        if tensor.requires_grad:
            stage = position.get(graph.tensor_layers[tid], last)
            loss_gradient[stage] += (
                part * local_bytes(tensor, assignment, sizes) * 4.0 / tensor.itemsize
            )
    # The reduction XLA combines with the loss's, held from the head's
    # backward pass to the step's end (`loss_reduction`).
    held_to_end = [0.0] * len(stages)
    for out, size, per_batch in loss_combined_reductions(graph, assignment, sizes):
        head = position.get(graph.tensor_layers[out], last)
        for i in range(head + 1):
            held_to_end[i] += size * (part if per_batch else 1.0)
    batch_axes = {assignment.class_axis.get(c) for c in batch_classes} - {None}
    split = merged_split_gradient_bytes(graph, whole, sizes)
    partials = [0.0] * len(stages)  # split-K partial products made there
    # Split partials of gradients no batch axis reduces, summed by their
    # update (`_update_read_partials`).
    update_read = [0.0] * len(stages)
    made_above = [0.0] * (len(stages) + 1)  # gradients of stages >= i
    combined = [0.0] * len(stages)  # the largest combined reduction so far
    group = largest_group = 0.0
    all_reduced = 0.0  # gradients reduced whole (not stored cut over the batch)
    # A gradient the batch reduces, of a parameter read through a narrowing
    # cast, is the cast's: XLA:GPU reduces it in the cast's precision and
    # holds it so until the updates, which widen it as they read it (six
    # 1024-wide Dense layers on 2x4 under `mixed_bfloat16` peak with one
    # combined bfloat16 all-reduce, 3 MiB operand and result, where float32
    # would be 6 MiB each; six 8192-wide ones on 8x1, each kernel's reduced
    # alone, hold them in bfloat16 too: `tests/planner/test_held_gradients_gpu.py`).
    # One no batch axis reduces is widened where it is made (1x8). Not
    # followed: a weight stored cut over the batch axis whose gradient XLA
    # all-reduces whole, then widens and holds whole in float32 before it
    # takes its shard (Mixtral-8x7B widths on 8x8: 224 MiB an expert kernel,
    # counted here at its shard in bfloat16).
    # A rematerialized layer runs its backward pass inside its optimization
    # barrier: the cast's gradient is reduced and widened there, held in
    # float32, and no reduction combines it with another layer's (six
    # 1024-wide Dense layers on 2x4, all rematerialized, under
    # `mixed_bfloat16`: 1.02 of the compiled peak, 1.12 with the gradients
    # widened and the six layers' reductions still combined; ViT-22B's
    # widths on 32x8 at 2-8 rematerialized layers: 0.97-0.91 counted in
    # bfloat16, 216 MiB of float32 gradients a layer).
    narrowed = graph.narrowed_params
    for i in reversed(range(len(stages))):
        made_above[i] = made_above[i + 1]
        rematerialized = i < len(calls) and calls[i] in remat
        if rematerialized:
            largest_group, group = max(largest_group, group), 0.0
        for tid in stages[i].gradients:
            tensor = graph.tensors[tid]
            reduced = batch_axes - set(tensor_axes(tensor, whole))
            factor = narrowed.get(tid, 1.0) if reduced else 1.0
            made_above[i] += local_bytes(tensor, assignment, sizes) * (
                1.0 if rematerialized else factor
            )
            partials[i] = max(partials[i], split.get(tid, 0.0))
            if not reduced and not rematerialized:
                update_read[i] = max(update_read[i], split.get(tid, 0.0))
            if reduced:
                # Combined in the order they are made, up to the threshold.
                size = local_bytes(tensor, whole, sizes) * factor
                if group + size > COMBINE_THRESHOLD_BYTES:
                    largest_group, group = max(largest_group, group), 0.0
                group += size
                if not reduce_scattered(tensor, assignment, batch_axes):
                    all_reduced += size
        combined[i] = max(largest_group, group)
        if rematerialized:
            largest_group, group = max(largest_group, group), 0.0
    # One device keeps the accumulating conditional, and copies of the
    # accumulators it reads through the backward pass.
    one_device = math.prod(sizes.values()) == 1
    copies = accumulated_bytes if one_device else 0.0
    pending_update = _update_read_partials(update_read)
    peak_tensors = {calls[i]: tid for i, tid in largest_of.items() if i < len(calls)}
    gathered = gathered_by_stage(
        graph, planned, assignment, sizes, remat, kept, recomputed, peak_tensors
    )
    # Where a layer's largest buffer is the split input gradients of an
    # activation several of its products read, XLA:GPU forms that sum
    # before the layer's weight gradients: they are not held beside it (the
    # zoo's Gemma on 2x4 peaks as its top block's backward pass starts, its
    # gate and up projections' input gradients in four partials each, 2 MiB,
    # with no weight gradient of the block made; 1.11 of its compiled peak
    # counted with them, 1.06 without; its Llama 0.95 -> 0.90, the peak
    # later, in weight-gradient products XLA:GPU defers with 80 GB free;
    # `tests/planner/test_input_gradient_chain_gpu.py`). A rematerialized
    # layer's barrier returns its weight gradients with its input's, so it
    # is left as it is. None at real widths (no split input gradient).
    summed = split_sums_of_several_products(graph, products)
    chain_first = {i for i, tid in largest_of.items() if tid in summed}
    best = (-1.0, 0.0, 0.0, 0.0)
    alive = 0.0  # what the stages up to this one still read
    for i, stage in enumerate(stages):
        alive += held(stage.kept_to_here)
        kept = alive + held(stage.own) + gathered[i] * part
        formed_here = (
            max(largest[i] + partials[i], formed[i])
            + loss_gradient[i]
            + pending_update[i]
        )
        workspace = max(formed_here, combined[i]) + held_to_end[i] + copies
        made = made_above[i]
        own_chain_first = (
            i in chain_first
            and i < len(calls)
            and calls[i] not in remat
            and largest[i] + partials[i] >= formed[i]
        )
        if own_chain_first:
            made = made_above[i + 1]
        best = max(best, (kept + made + workspace, kept, made, workspace))
    if updated_bytes and one_device:
        # The conditional's update reads each gradient as it is made.
        best = max(best, (updated_bytes, 0.0, 0.0, updated_bytes))
    elif updated_bytes:
        # The all-reduced gradients' combined operand is held to the update
        # (a gradient stored cut over the batch is reduce-scattered in the
        # backward pass: its shard alone is held).
        update = updated_bytes + min(all_reduced, COMBINE_THRESHOLD_BYTES)
        best = max(best, (made_above[0] + update, 0.0, made_above[0], update))
    return best[1], best[2], best[3]


def _grow(
    largest: list[float], largest_of: dict[int, int], stage: int, size: float, tid: int
) -> None:
    """Raise `largest[stage]` to `size`, noting `tid` where it grows."""
    if size > largest[stage]:
        largest[stage] = size
        largest_of[stage] = tid


def _update_read_partials(update_read: list[float]) -> list[float]:
    """Per stage, the split partials of a layer above whose update has not
    yet run.

    Where no batch axis reduces a weight gradient XLA:GPU splits over the
    tokens (`split_k.merged_split_gradient_bytes`), nothing needs the sum
    before the optimizer: XLA:GPU fuses the sum of the partials into the
    weight's update, which reads them, so they are held from their product
    to that update (a rematerialized layer returns its gradients summed,
    through its optimization barrier). XLA:GPU runs each update after its
    layer's product, before the next layer's, except at the end of the
    backward pass: the two lowest such layers' products both run before
    either update, their partials live at once (read off the compiled
    programs of `tests/planner/test_update_read_partials_gpu.py`). The zoo
    MLP on 1x8 makes `mlp_down`'s `f32[16,64,128]` partials, then
    `mlp_up`'s `f32[16,128,64]`, then runs `mlp_down`'s update, both 512 KiB
    live at its peak: counting one set at a time put it at 0.89 of the
    compiled peak (now 1.03), the same MLP with a ReLU at 0.79 (now 0.98);
    four Dense layers hold two sets at their last two products only (0.96
    either way; every layer's held to the updates put it at 1.30).

    Args:
        update_read: Per stage, the largest of its layer's split partials
            summed by their update (0 for none).

    Returns:
        Per stage, bytes of a layer above's partials still held there.
    """
    pending = [0.0] * len(update_read)
    making = [i for i, size in enumerate(update_read) if size]
    if len(making) >= 2:
        pending[making[0]] = update_read[making[1]]
    return pending
