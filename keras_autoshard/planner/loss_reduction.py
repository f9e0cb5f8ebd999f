"""The reduction XLA:GPU combines with the loss's, held to the step's end.

Where mesh axes cut the model's outputs, the loss sums over them: an
all-reduce over those axes, whose result the step reads only at its end
(the loss value it returns). XLA's all-reduce combiner packs that small
reduction with the first independent one over the same devices, and where
that one is made at the top of the backward pass (the head's input
gradient, or a tied weight's gradient from its upper read), the combined
buffer stays live to the step's end, beside the slice of it the backward
pass reads. `accelerator_peak` counts it from the head's stage down.

Read off XLA:GPU's programs for 8 H100s (`benchmarks/memory_truth_gpu.py`,
checked in `tests/planner/test_loss_reduction_gpu.py`):

- a Dense head whose 16 outputs `model` cuts (1x8): its input's gradient,
  partial over `model`, is all-reduced with the loss's per-token sums
  (`f32[66048]`: 65536 + 512) from the head's backward pass to the step's
  end;
- a tied embedding read again as the output projection, the batch cut over
  `model` (1x8): the projection's gradient, partial over `model`, is
  all-reduced with the loss's sum (`f32[131073]`), and held so until the
  end while the embedding's own gradient is formed.
"""

from __future__ import annotations

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.cost_model import Assignment, local_bytes, tensor_axes


def loss_made_tensors(graph: AxisGraph) -> set[int]:
    """The outputs, and the products whose image is an output (a bias
    added): tensors whose gradient the loss writes.

    Args:
        graph: The model's axis graph.

    Returns:
        Their tensor ids.
    """
    made = set(graph.outputs)
    made.update(o for o, images, _ in graph.fused_products if made.intersection(images))
    return made


def loss_combined_reductions(
    graph: AxisGraph,
    assignment: Assignment,
    sizes: dict[str, int],
) -> list[tuple[int, float, bool]]:
    """The reductions the head's backward pass makes over exactly the axes
    that cut the outputs (those XLA combines with the loss's own).

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding. A weight stored cut over one of
            those axes has its gradient reduce-scattered, which XLA does not
            combine with the loss's all-reduce (a tied table stored cut on
            8x1: `f32[129]`, the loss's reduction alone).
        sizes: Mesh axis name -> size.

    Returns:
        `(head output id, bytes per device, scales with the batch)` of each:
        a product making an output (`loss_made_tensors`) whose weight's cut
        output dims leave its input's gradient partial over those axes (the
        input's gradient, an activation), or whose weight another layer
        reads too and whose batch dims those axes cut (the weight's
        gradient, summed with the other read's in the backward pass).
    """
    loss_axes = {
        axis
        for tid in graph.outputs
        for axis in tensor_axes(graph.tensors[tid], assignment)
        if axis is not None and sizes.get(axis, 1) > 1
    }
    if not loss_axes:
        return []
    loss_made = loss_made_tensors(graph)
    readers = dict(graph.param_readers)
    found = []
    for out, lhs, rhs, free in graph.products:
        if out not in loss_made:
            continue
        out_axes = tensor_axes(graph.tensors[out], assignment)
        lhs_tensor, rhs_tensor = graph.tensors[lhs], graph.tensors[rhs]
        # The input's gradient contracts the output's dims the weight gives:
        # partial over the loss's axes that cut those and not the input.
        partial = loss_axes.intersection(out_axes[free:])
        partial -= set(tensor_axes(lhs_tensor, assignment))
        if lhs_tensor.requires_grad and partial == loss_axes:
            found.append((out, local_bytes(lhs_tensor, assignment, sizes), True))
        # The weight's gradient contracts the output's dims the input gives.
        partial = loss_axes.intersection(out_axes[:free])
        partial -= set(tensor_axes(rhs_tensor, assignment))
        if len(readers.get(rhs, ())) > 1 and partial == loss_axes:
            found.append((out, local_bytes(rhs_tensor, assignment, sizes), False))
    return found
