"""How many parts XLA:GPU splits a weight gradient's contraction into.

A weight gradient contracts over the tokens (`K`: batch × sequence on one
device) into an output of the weight's size. When that output is small
against `K`, XLA:GPU splits the contraction ("split-K"): `S` partial
products of the output's size, in float32, summed afterwards.
`memory_model.accelerator_peak` counts every partial buffer of a layer's
weight gradients (`split_gradient_bytes`) while that layer's backward pass
runs. Read off XLA:GPU's buffers at the compiled peak of the zoo's Llama on
2x4: `f32[8,128,256]` partial products (8 of them over 256 local tokens)
beside the layer's other buffers. Some outlive their layer's backward
pass, but counting every one of them until the updates put the zoo's
KerasHub transformers at up to 1.70 of their compiled peak
(`benchmarks/memory_truth_gpu.py`), against 1.04 for that Llama with the
layer's own.

`SPLITS` is what XLA:GPU (jax 0.10.2, default options, compiled for one
H100 ahead of time) chose for a lone `einsum("km,kn->mn")` of `K` tokens
into `M × N` elements, float32 or bfloat16 alike, on a grid of powers of
two (`python -m benchmarks.split_k_probe` prints it). Between grid points
the lower `K` and the lower element count are read: the lower element count
gives more parts (`S` falls with it), the lower `K` fewer (`S` grows with
it), so between powers of two of `K` the buffer may be under-counted, by at
most the next row's factor (2 on the grid). From
4 Mi elements on (a 2048 × 2048 shard), XLA:GPU does not split: weights at
real widths are never split.

Example:

```python
split_parts(tokens=256, elements=128 * 256)  # 8
```
"""

from __future__ import annotations

import bisect
import math

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.cost_model import Assignment, local_bytes

# log2(K) -> (log2(elements) from which, parts) for increasing element
# counts; printed as is by `python -m benchmarks.split_k_probe`.
SPLITS: dict[int, tuple[tuple[int, int], ...]] = {
    7: ((12, 8), (16, 4), (18, 1)),
    8: ((12, 8), (16, 4), (18, 1)),
    9: ((12, 16), (16, 8), (18, 4), (19, 1)),
    10: ((12, 16), (16, 8), (18, 4), (20, 1)),
    11: ((12, 32), (16, 16), (18, 8), (19, 4), (20, 2), (22, 1)),
    12: ((12, 32), (16, 16), (18, 8), (19, 4), (20, 2), (22, 1)),
    13: ((12, 64), (16, 32), (18, 8), (19, 4), (20, 2), (22, 1)),
    14: ((12, 64), (16, 32), (18, 8), (19, 4), (20, 2), (22, 1)),
    15: ((12, 128), (16, 32), (18, 8), (19, 4), (22, 1)),
    17: ((12, 256), (14, 128), (16, 32), (18, 16), (19, 8), (20, 4), (22, 1)),
}
# No split from this many output elements on, whatever K.
UNSPLIT_ELEMENTS = 2**22


def split_parts(tokens: float, elements: float) -> int:
    """Partial products XLA:GPU makes for a contraction of `tokens` into
    `elements` outputs (1: not split).

    Args:
        tokens: The contracted size on one device.
        elements: The output's elements on one device.

    Returns:
        The number of partial products (at least 1).
    """
    if elements >= UNSPLIT_ELEMENTS or tokens < 2**7 or elements < 1:
        return 1
    rows = sorted(SPLITS)
    row = SPLITS[rows[max(0, bisect.bisect_right(rows, math.log2(tokens)) - 1)]]
    at = max(0, bisect.bisect_right([e for e, _ in row], math.log2(elements)) - 1)
    return row[at][1]


def split_gradient_bytes(
    graph: AxisGraph, assignment: Assignment, sizes: dict[str, int]
) -> dict[int, float]:
    """Parameter id -> bytes of its gradient's partial products where
    XLA:GPU splits the weight-gradient contraction (`split_k.split_parts`:
    small weights against many tokens), live until they are summed.

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding, FSDP cuts left out (the
            gradient is formed in the compute layout).
        sizes: Mesh axis name -> size.

    Returns:
        Float32 bytes of the partial products per device, for the
        parameters whose gradient is split (others are absent).
    """
    held: dict[int, float] = {}
    for event in graph.comm_events:
        tensor = graph.tensors[event.tensor]
        if event.kind != "contract" or event.phase != "backward":
            continue
        if tensor.kind != "param":
            continue
        tokens = 1.0
        for cls in event.classes:
            axis = assignment.class_axis.get(cls)
            tokens *= graph.classes[cls].size / (sizes[axis] if axis else 1)
        elements = local_bytes(tensor, assignment, sizes) / tensor.itemsize
        parts = split_parts(tokens, elements)
        if parts > 1:
            held[tensor.id] = max(held.get(tensor.id, 0.0), 4.0 * parts * elements)
    return held
