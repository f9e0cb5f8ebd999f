"""How many parts XLA:GPU splits a product's contraction into, and what
it holds for it.

A weight gradient contracts over the tokens (`K`: batch × sequence on one
device) into an output of the weight's size. When that output is small
against `K`, XLA:GPU splits the contraction ("split-K"): `S` partial
products of the output's size, in float32, summed afterwards.
`accelerator_peak.accelerator_peak` counts the largest product's partials of
a layer's weight gradients (`merged_split_gradient_bytes`: the weights that
read one input are one product) while that layer's
backward pass runs: each product's are summed as it is made (read off
XLA:GPU's buffers at the compiled peak of the zoo's Llama on 2x4:
`f32[8,128,256]` partial products, 8 of them over 256 local tokens, beside
the layer's other buffers; counting every one of them until the updates put
the zoo's KerasHub transformers at up to 1.70 of their compiled peak, and
all of a layer's at once GPT-2 on 2x4 at 1.11, `benchmarks/memory_truth_gpu.py`).

`SPLITS` is what XLA:GPU (jax 0.10.2, default options, compiled for one
H100 ahead of time) chose for a lone `einsum("km,kn->mn")` of `K` tokens
into an `M × N` output, float32 or bfloat16 alike, on a grid of powers of
two (`python -m benchmarks.split_k_probe` prints it). The choice depends on
both output dims, not on their product alone: over 512 tokens a 256 × 32
output is split in 8, a 64 × 128 one, as many elements, in 16 (a table by
element count, read off square outputs, counted 16 for the zoo Llama's
query kernel on 1x8, where its compiled program makes 8). Between grid
points the lower `K` is read (as many parts or fewer) and the nearest `M`
and `N` (a merged query, key and value gradient of 256 × 192 over 256
tokens is split in 4, as 256 × 256 is, where 256 × 128 is split in 8), so
the buffer may be under-counted by at most the next row's or column's
factor (2 on the grid). A weight gradient is the product of the layer's input and
its output's gradient: `M` is the weight's dims shared with the input,
`N` the others (an attention output kernel `(heads, head_dim, hidden)` is
`heads × head_dim` by `hidden`). The weight gradients of products that
read one input are one product (XLA's `DotMerger`: a Llama's query, key
and value kernels, over 512 tokens on 1x8, make one `f32[8,96,256]`, and
its gate and up projections one `f32[8,256,128]`): their `N`s add up,
which may make fewer parts. From 4 Mi elements on (a 2048 × 2048 shard), XLA:GPU does
not split: weights at real widths are never split. The gradient of a
table read by a gather is a scatter-add, not a product: never split.

The same splits hold for the other products of a layer on few tokens,
read off the compiled programs of the zoo and of
`tests/planner/test_split_products_gpu.py`: a forward product whose output only
elementwise work reads keeps its partials for the backward pass
(`kept_partials_factors`), and the input gradient of an activation is
split too, each product's partials live until one fusion sums them with
the other products' (`gradient_buffers`).

Example:

```python
split_parts(tokens=256, m=128, n=256)  # 8
```
"""

from __future__ import annotations

import bisect
import collections
import math

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.cost_model import Assignment, tensor_axes

# log2(K) -> rows by log2(M) from DIMS_LOG2[0], each the parts by log2(N)
# from DIMS_LOG2[0]; printed as is by `python -m benchmarks.split_k_probe`.
SPLITS: dict[int, tuple[tuple[int, ...], ...]] = {
    7: (
        (1, 1, 1, 1, 1, 1, 1, 1, 1),  # M = 2**4
        (1, 1, 1, 8, 4, 1, 1, 1, 1),  # M = 2**5
        (1, 1, 8, 8, 4, 1, 1, 1, 1),  # M = 2**6
        (1, 8, 8, 8, 4, 4, 1, 1, 1),  # M = 2**7
        (1, 4, 4, 4, 4, 1, 1, 1, 1),  # M = 2**8
        (1, 1, 1, 4, 1, 1, 1, 1, 1),  # M = 2**9
        (1, 1, 1, 1, 1, 1, 1, 1, 1),  # M = 2**10
        (1, 1, 1, 1, 1, 1, 1, 1, 1),  # M = 2**11
        (1, 1, 1, 1, 1, 1, 1, 1, 1),  # M = 2**12
    ),
    8: (
        (1, 1, 1, 8, 8, 4, 1, 1, 1),  # M = 2**4
        (1, 1, 8, 8, 8, 4, 1, 1, 1),  # M = 2**5
        (1, 8, 8, 8, 8, 4, 4, 1, 1),  # M = 2**6
        (8, 8, 8, 8, 8, 4, 4, 1, 1),  # M = 2**7
        (8, 8, 8, 8, 4, 4, 1, 1, 1),  # M = 2**8
        (4, 4, 4, 4, 4, 1, 1, 1, 1),  # M = 2**9
        (1, 1, 4, 4, 1, 1, 1, 1, 1),  # M = 2**10
        (1, 1, 1, 1, 1, 1, 1, 1, 1),  # M = 2**11
        (1, 1, 1, 1, 1, 1, 1, 1, 1),  # M = 2**12
    ),
    9: (
        (1, 1, 16, 16, 8, 8, 4, 1, 1),  # M = 2**4
        (1, 16, 16, 16, 8, 8, 4, 4, 1),  # M = 2**5
        (16, 16, 16, 16, 8, 8, 4, 4, 1),  # M = 2**6
        (16, 16, 16, 16, 8, 8, 4, 4, 1),  # M = 2**7
        (8, 8, 8, 8, 8, 4, 4, 1, 1),  # M = 2**8
        (8, 8, 8, 8, 4, 4, 1, 1, 1),  # M = 2**9
        (4, 4, 4, 4, 4, 1, 1, 1, 1),  # M = 2**10
        (1, 4, 4, 4, 1, 1, 1, 1, 1),  # M = 2**11
        (1, 1, 1, 1, 1, 1, 1, 1, 1),  # M = 2**12
    ),
    10: (
        (16, 16, 16, 16, 16, 8, 8, 4, 4),  # M = 2**4
        (16, 16, 16, 16, 16, 8, 8, 4, 4),  # M = 2**5
        (16, 16, 16, 16, 16, 8, 8, 4, 4),  # M = 2**6
        (16, 16, 16, 16, 16, 8, 8, 4, 4),  # M = 2**7
        (16, 16, 16, 16, 8, 8, 4, 4, 1),  # M = 2**8
        (8, 8, 8, 8, 8, 4, 4, 1, 1),  # M = 2**9
        (8, 8, 8, 8, 4, 4, 1, 1, 1),  # M = 2**10
        (4, 4, 4, 4, 4, 1, 1, 1, 1),  # M = 2**11
        (4, 4, 4, 4, 1, 1, 1, 1, 1),  # M = 2**12
    ),
    11: (
        (32, 32, 32, 32, 16, 16, 8, 8, 4),  # M = 2**4
        (32, 32, 32, 32, 16, 16, 8, 8, 4),  # M = 2**5
        (32, 32, 32, 32, 16, 16, 8, 8, 4),  # M = 2**6
        (32, 32, 32, 32, 16, 16, 8, 8, 4),  # M = 2**7
        (16, 16, 16, 16, 16, 8, 8, 4, 2),  # M = 2**8
        (16, 16, 16, 16, 8, 8, 4, 2, 1),  # M = 2**9
        (8, 8, 8, 8, 8, 4, 2, 1, 1),  # M = 2**10
        (8, 8, 8, 8, 4, 2, 1, 1, 1),  # M = 2**11
        (4, 4, 4, 4, 2, 1, 1, 1, 1),  # M = 2**12
    ),
    12: (
        (32, 32, 32, 32, 32, 16, 16, 8, 8),  # M = 2**4
        (32, 32, 32, 32, 32, 16, 16, 8, 8),  # M = 2**5
        (32, 32, 32, 32, 32, 16, 16, 8, 8),  # M = 2**6
        (32, 32, 32, 32, 32, 16, 16, 8, 4),  # M = 2**7
        (32, 32, 32, 32, 16, 16, 8, 4, 2),  # M = 2**8
        (16, 16, 16, 16, 16, 8, 4, 2, 1),  # M = 2**9
        (16, 16, 16, 16, 8, 4, 2, 1, 1),  # M = 2**10
        (8, 8, 8, 8, 4, 2, 1, 1, 1),  # M = 2**11
        (8, 8, 8, 4, 2, 1, 1, 1, 1),  # M = 2**12
    ),
    13: (
        (64, 64, 64, 64, 32, 32, 16, 16, 8),  # M = 2**4
        (64, 64, 64, 64, 32, 32, 16, 16, 8),  # M = 2**5
        (64, 64, 64, 64, 32, 32, 16, 16, 8),  # M = 2**6
        (64, 64, 64, 64, 32, 32, 16, 8, 4),  # M = 2**7
        (32, 32, 32, 32, 32, 16, 8, 4, 2),  # M = 2**8
        (32, 32, 32, 32, 16, 8, 4, 2, 1),  # M = 2**9
        (16, 16, 16, 16, 8, 4, 2, 1, 1),  # M = 2**10
        (16, 16, 16, 8, 4, 2, 1, 1, 1),  # M = 2**11
        (8, 8, 8, 4, 2, 1, 1, 1, 1),  # M = 2**12
    ),
    14: (
        (64, 64, 64, 64, 64, 32, 32, 16, 16),  # M = 2**4
        (64, 64, 64, 64, 64, 32, 32, 16, 16),  # M = 2**5
        (64, 64, 64, 64, 64, 32, 32, 16, 8),  # M = 2**6
        (64, 64, 64, 64, 64, 32, 16, 8, 4),  # M = 2**7
        (64, 64, 64, 64, 32, 16, 8, 4, 2),  # M = 2**8
        (32, 32, 32, 32, 16, 8, 4, 2, 1),  # M = 2**9
        (32, 32, 32, 16, 8, 4, 2, 1, 1),  # M = 2**10
        (16, 16, 16, 8, 4, 2, 1, 1, 1),  # M = 2**11
        (16, 16, 8, 4, 2, 1, 1, 1, 1),  # M = 2**12
    ),
    15: (
        (128, 128, 128, 128, 64, 64, 32, 32, 16),  # M = 2**4
        (128, 128, 128, 128, 64, 64, 32, 32, 16),  # M = 2**5
        (128, 128, 128, 128, 64, 64, 32, 16, 8),  # M = 2**6
        (128, 128, 128, 128, 64, 32, 16, 8, 4),  # M = 2**7
        (64, 64, 64, 64, 32, 16, 8, 4, 4),  # M = 2**8
        (64, 64, 64, 32, 16, 8, 4, 4, 1),  # M = 2**9
        (32, 32, 32, 16, 8, 4, 4, 1, 1),  # M = 2**10
        (32, 32, 16, 8, 4, 4, 1, 1, 1),  # M = 2**11
        (16, 16, 8, 4, 4, 1, 1, 1, 1),  # M = 2**12
    ),
    17: (
        (256, 256, 256, 256, 128, 128, 64, 64, 32),  # M = 2**4
        (256, 256, 256, 256, 128, 128, 64, 32, 16),  # M = 2**5
        (256, 256, 256, 256, 128, 64, 32, 16, 8),  # M = 2**6
        (256, 256, 256, 128, 64, 32, 16, 16, 8),  # M = 2**7
        (128, 128, 128, 64, 32, 16, 16, 8, 4),  # M = 2**8
        (128, 128, 64, 32, 16, 16, 8, 4, 2),  # M = 2**9
        (64, 64, 32, 16, 16, 8, 4, 2, 1),  # M = 2**10
        (64, 32, 16, 16, 8, 4, 2, 1, 1),  # M = 2**11
        (32, 16, 8, 8, 4, 2, 1, 1, 1),  # M = 2**12
    ),
}
DIMS_LOG2 = (4, 12)  # the grid's least and greatest output dim, log2
# No split from this many output elements on, whatever K.
UNSPLIT_ELEMENTS = 2**22
# The most partial results XLA:GPU keeps in a forward product's output's
# place (`kept_partials_factors`) where an expensive primitive reads its sum
# (`AxisGraph.expensively_read_products`): the zoo's GPT-2 and Gemma on 2x4,
# 1x8 and 8x1 keep their GELU products' 4 partials; BERT on 2x4, split in 8,
# has its forward fusion emit the biased product beside the GELU it feeds.
KEPT_PARTS_LIMIT = 4
# The same where only cheap work reads it (a ReLU's `max`): the zoo's OPT on
# 2x4 keeps its ReLU products' 8 partials, in float32 and under
# `mixed_bfloat16` (`tests/planner/test_kept_partials_gpu.py`: a ReLU block
# keeps them where the same block with GELU does not). Not measured beyond 8.
CHEAPLY_READ_KEPT_PARTS_LIMIT = 8


def split_parts(tokens: float, m: float, n: float) -> int:
    """Partial products XLA:GPU makes for a contraction of `tokens` into an
    `m × n` output (1: not split).

    Args:
        tokens: The contracted size on one device.
        m: The output's first dim on one device.
        n: The output's second dim on one device.

    Returns:
        The number of partial products (at least 1).
    """
    if m * n >= UNSPLIT_ELEMENTS or tokens < 2**7 or min(m, n) < 1:
        return 1
    rows = sorted(SPLITS)
    table = SPLITS[rows[max(0, bisect.bisect_right(rows, math.log2(tokens)) - 1)]]
    low, high = DIMS_LOG2

    def index(size: float) -> int:
        return min(max(round(math.log2(size)), low), high) - low

    return table[index(m)][index(n)]


def merged_split_gradient_bytes(
    graph: AxisGraph, assignment: Assignment, sizes: dict[str, int]
) -> dict[int, float]:
    """Parameter id -> bytes of the partial products where XLA:GPU splits
    the contraction that makes its gradient (`split_parts`: small weights
    against many tokens), live until they are summed: those of the whole
    merged product, where weights read one input over the same tokens (a
    query, key and value Dense's, 3 x 256 KiB on a 256-wide block split in
    4, made at once, XLA's `DotMerger`: `tests/planner/test_kept_partials_gpu.py`).

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding, FSDP cuts left out (the
            gradient is formed in the compute layout).
        sizes: Mesh axis name -> size.

    Returns:
        Float32 bytes of the partial products per device, for the
        parameters whose gradient is split (others are absent).
    """
    # A weight read in a lower precision (`mixed_bfloat16`) is contracted as
    # its cast (`AxisGraph.param_casts`).
    weights = {t.id: t for t in graph.tensors if t.kind == "param"}
    weights.update((cast, weights[param]) for cast, param in graph.param_casts)
    input_of: dict[int, int] = {}
    for lhs, rhs in graph.matmul_pairs:
        input_of.setdefault(lhs, rhs)
        input_of.setdefault(rhs, lhs)
    # (input, tokens, M) -> {read tensor: (weight, N)}: one product per group.
    groups: dict[tuple, dict[int, tuple[int, float]]] = {}
    for event in graph.comm_events:
        if event.kind != "contract" or event.phase != "backward":
            continue
        if "dot_general" not in event.primitive.split("+"):
            continue  # a gather's scatter-add, a convolution: no partials
        weight = weights.get(event.tensor)
        if weight is None:
            continue
        tokens = 1.0
        for cls in event.classes:
            axis = assignment.class_axis.get(cls)
            tokens *= graph.classes[cls].size / (sizes[axis] if axis else 1)
        source = input_of.get(event.tensor)
        # Each of the input's classes stands for one of the weight's dims
        # (a square kernel read as `h @ W` has one class on both dims).
        shared = collections.Counter(
            graph.tensors[source].dim_classes if source is not None else ()
        )
        m = n = 1.0
        for size, axis, cls in zip(
            weight.shape, tensor_axes(weight, assignment), weight.dim_classes
        ):
            local = size / (sizes[axis] if axis else 1)
            if cls is not None and shared[cls] > 0:
                shared[cls] -= 1
                m *= local
            else:
                n *= local
        groups.setdefault((source, tokens, m), {})[event.tensor] = (weight.id, n)
    merged: dict[int, float] = {}
    for (_, tokens, m), members in groups.items():
        total_n = sum(n for _, n in members.values())
        parts = split_parts(tokens, m, total_n)
        if parts == 1:
            continue
        total = 4.0 * parts * m * total_n
        for weight_id, _ in members.values():
            merged[weight_id] = max(merged.get(weight_id, 0.0), total)
    return merged


def _local_size(tensor, assignment: Assignment, sizes, dims) -> float:
    axes = tensor_axes(tensor, assignment)
    return math.prod(tensor.shape[d] / (sizes[axes[d]] if axes[d] else 1) for d in dims)


# Operand kinds a product's split partials are counted for.
_PRODUCT_OPERAND_KINDS = ("activation", "input")
# (output, activation operand, M, K, N) of one product on one device.
ProductDims = tuple[int, int, float, float, float]


def activation_products(
    graph: AxisGraph, assignment: Assignment, sizes: dict[str, int]
) -> list[ProductDims]:
    """(output, activation operand, M, K, N) on one device of each
    unbatched product one of whose operands is an activation or the model's
    input: `M` the output's dims that come from it, `K` the contraction,
    `N` the rest. A Dense layer reading the model's input keeps its split
    partials as one reading an activation does (a ReLU MLP on 2x4 keeps its
    first layer's four, 512 KiB; left out, its estimate was 0.71 of the
    compiled peak, now 0.93: `tests/planner/test_update_read_partials_gpu.py`);
    the input needs no gradient, so no input-gradient partials are counted
    for it (`_split_input_gradients`).

    Args:
        graph: The model's axis graph.
        assignment: The candidate sharding, FSDP cuts left out (products
            run in the compute layout).
        sizes: Mesh axis name -> size.

    Returns:
        One entry per product, in `AxisGraph.products` order.
    """
    contracted = graph.product_contractions
    kinds = _PRODUCT_OPERAND_KINDS
    found = []
    for out, lhs, rhs, lhs_free in graph.products:
        read = lhs if graph.tensors[lhs].kind in kinds else rhs
        output = graph.tensors[out]
        if graph.tensors[read].kind not in kinds or out not in contracted:
            continue
        rank = len(output.shape)
        dims = range(lhs_free) if read == lhs else range(lhs_free, rank)
        m = _local_size(output, assignment, sizes, dims)
        n = _local_size(output, assignment, sizes, range(rank)) / m
        k = 1.0
        for cls in contracted[out]:
            axis = assignment.class_axis.get(cls)
            k *= graph.classes[cls].size / (sizes[axis] if axis else 1)
        found.append((out, read, m, k, n))
    return found


def kept_partials_factors(
    graph: AxisGraph, products: list[ProductDims], kept: frozenset[int]
) -> dict[int, float]:
    """Output id -> bytes XLA:GPU keeps per byte of the output, for the
    kept outputs of products whose partial results it keeps instead.

    A forward product split over its contraction (`split_parts`: few
    tokens against many features) ends in a sum of `S` float32 partial
    results, which XLA:GPU fuses into the product's readers. Where only
    elementwise work reads the output (`AxisGraph.fused_products`: a
    GELU's input, a gated MLP's gate) and the backward pass keeps it, the
    backward fusions sum the partials again: the `S` partials are kept
    (up to `KEPT_PARTS_LIMIT` where an expensive primitive reads the sum,
    `CHEAPLY_READ_KEPT_PARTS_LIMIT` where only cheap work does; none where
    the product makes attention heads itself), and the kept value too where
    a product reads it (its weight gradient does: the zoo's tied model keeps its tanh
    Dense's four partials and their sum, the subclassed model under
    `mixed_bfloat16` its ReLU Dense's partials and the bfloat16 ReLU).
    Products reading one input are one product (`DotMerger`), whose
    partials hold every member's output: the kept members carry the whole.

    Args:
        graph: The model's axis graph.
        products: `activation_products` of the candidate sharding.
        kept: The activations the backward pass keeps.

    Returns:
        The factor of each kept output whose product's partials are kept
        (others absent).
    """
    # Output -> the kept value that stands for it (itself or an image).
    held_as = {}
    for out, images, needed in graph.fused_products:
        held = [tid for tid in (out, *images) if needed and tid in kept]
        if held:
            held_as[out] = held[0]
    fused = {out for out, _, _ in graph.fused_products}
    # (input, M, K) -> [(output, N)]: one product per group.
    groups: dict[tuple, list[tuple[int, float]]] = {}
    for out, read, m, k, n in products:
        groups.setdefault((read, m, k), []).append((out, n))
    # Read by an unbatched product, whose weight gradient reads it. Not
    # `AxisGraph.matmul_operand_ids`, which holds the heads the attention's
    # batched products read too: counting them beside the merged
    # query-key-value partials put the zoo's transformers 0.01-0.02 higher
    # (GPT-2 on 2x4, already over, further), where XLA:GPU frees the
    # partials once it has made the heads.
    read_by_products = {t for _, lhs, rhs, _ in graph.products for t in (lhs, rhs)}
    # A product whose weight has two free dims or more makes attention heads
    # itself (KerasHub's `EinsumDense` "abc,cde->abde"): XLA:GPU makes the
    # biased heads in the layout the attention reads and frees the partials
    # (a Dense whose output is reshaped into heads keeps them, to make a
    # head again in the backward pass: `tests/planner/test_kept_partials_gpu.py`).
    makes_heads = {
        out for out, _, _, lhs_free in graph.products
        if len(graph.tensors[out].shape) - lhs_free > 1
    }  # fmt: skip
    expensive = set(graph.expensively_read_products)
    factors = {}
    for (_, m, k), members in groups.items():
        if any(out not in fused or out in makes_heads for out, _ in members):
            continue  # the sum is materialised (unfusible reader, heads)
        total = sum(n for _, n in members)
        parts = split_parts(k, m, total)
        held = sum(n for out, n in members if out in held_as)
        limit = CHEAPLY_READ_KEPT_PARTS_LIMIT
        if expensive.intersection(out for out, _ in members):
            limit = KEPT_PARTS_LIMIT
        if not 1 < parts <= limit or not held:
            continue
        for out, _ in members:
            if out in held_as:
                tid = held_as[out]
                factors[tid] = parts * total / held * 4.0 / graph.tensors[tid].itemsize
                if tid in read_by_products:
                    factors[tid] += 1.0
    return factors


def norm_read_partials_factors(
    graph: AxisGraph,
    products: list[ProductDims],
    assignment: Assignment,
    sizes: dict[str, int],
    kept: frozenset[int],
) -> dict[int, float]:
    """Kept id -> bytes XLA:GPU keeps per byte of it, for the residual sums
    (or the products they are recomputed from, whichever is kept) whose
    split partial results a residual stream holds in place of the sum.

    A residual sum of a product split over its contraction
    (`AxisGraph.norm_read_products`), read by a norm that reduces a class
    cut across devices, is read by two kernels with the reduction's
    all-reduce between them (the sum of squares, then the scaling), and by
    the next residual sum and the backward pass: XLA:GPU materialises the
    stream's first such sum and fuses every later one's `S` float32
    partials (up to `CHEAPLY_READ_KEPT_PARTS_LIMIT`) into each of its
    readers, holding them to the backward pass where the sum would be.
    Where the norm's reduction is on one device, reduction and scaling are
    one kernel that writes the sum out; where the product's contraction is
    cut, its output is all-reduced whole. Read off XLA:GPU's program of a
    residual MLP stack with its hidden dim cut over `model` on 2x4
    (`tests/planner/test_kept_partials_gpu.py`: the second block's 8
    partials read in the backward pass, the first block's not; the same
    stack twice as wide, split in 16, writes its second sum out too) and
    of the zoo's Gemma with LoRA on 2x4 (its attention and MLP output
    products' 8 partials held from the first block's MLP on: 0.90 of the
    compiled peak before, 0.98 after).

    Args:
        graph: The model's axis graph.
        products: `activation_products` of the candidate sharding.
        assignment: The candidate sharding in the compute layout.
        sizes: Mesh axis name -> size.
        kept: The activations the backward pass keeps.

    Returns:
        The factor of each kept sum or product whose partials are held
        (others absent).
    """

    def cut(classes) -> bool:
        axes = (assignment.class_axis.get(c) for c in classes)
        return any(axis and sizes[axis] > 1 for axis in axes)

    dims = {out: (m, k, n) for out, _, m, k, n in products}
    contracted = graph.product_contractions
    factors = {}
    for out, total, reduced, chained in graph.norm_read_products:
        # Kept as the sum's own (where the fusion view stops at a layer
        # call's end) or as the product the sum is recomputed from.
        held = [tid for tid in (total, out) if tid in kept]
        if not chained or not held or out not in dims:
            continue
        if not cut(reduced) or cut(contracted.get(out, ())):
            continue
        m, k, n = dims[out]
        parts = split_parts(k, m, n)
        if 1 < parts <= CHEAPLY_READ_KEPT_PARTS_LIMIT:
            factors[held[0]] = parts * 4.0 / graph.tensors[held[0]].itemsize
    return factors


def input_gradient_partials(
    graph: AxisGraph, products: list[ProductDims]
) -> dict[int, int]:
    """Activation id -> the buffers of its size, beyond one per product that
    reads it, that XLA:GPU holds while it forms the activation's gradient:
    a product of the output's gradient and the weight contracts over the
    output's features into the activation's shape, split in `S` float32
    partials where `split_parts` says so, `S - 1` more. The partials are
    summed where the products' input gradients are (a gate and an up
    projection over 256 tokens on 2x4: two products split in 8, 16
    partials of the input's size live at once).

    Args:
        graph: The model's axis graph.
        products: `activation_products` of the candidate sharding.

    Returns:
        The extra buffers per activation a split product reads (others
        absent).
    """
    extra: dict[int, int] = {}
    for _, read, split in _split_input_gradients(graph, products):
        extra[read] = extra.get(read, 0) + split - 1
    return extra


def _split_input_gradients(
    graph: AxisGraph, products: list[ProductDims]
) -> list[tuple[int, int, int]]:
    """(product output, activation read, parts) of each product whose
    input gradient (the output's gradient times the weight, contracted over
    the output's features) XLA:GPU splits in `parts > 1`."""
    found = []
    for out, read, m, k, n in products:
        split = split_parts(n, m, k)
        if split > 1 and graph.tensors[read].requires_grad:
            found.append((out, read, split))
    return found


def partials_made_by(
    graph: AxisGraph, products: list[ProductDims]
) -> dict[int, tuple[int, ...]]:
    """Activation id -> the outputs of the products that make its
    gradient in split partials (`input_gradient_partials`). The backward
    pass of the layer making those outputs makes the partials and sums
    them, before it forms its own weight gradient's partials.

    Args:
        graph: The model's axis graph.
        products: `activation_products` of the candidate sharding.

    Returns:
        The reading products' outputs per activation (others absent).
    """
    readers: dict[int, tuple[int, ...]] = {}
    for out, read, _ in _split_input_gradients(graph, products):
        readers[read] = (*readers.get(read, ()), out)
    return readers


def gradient_buffers(graph: AxisGraph, products: list[ProductDims]) -> dict[int, int]:
    """Activation id -> buffers of its size XLA:GPU holds at once while it
    forms the activation's gradient, where more than one: for an
    activation several products read, each product's input gradient (a
    query, key and value projection reading one normalised input) and
    their sum, which one fusion makes after the last; each input gradient
    in its partials where XLA:GPU splits it (`input_gradient_partials`).

    Args:
        graph: The model's axis graph.
        products: `activation_products` of the candidate sharding.

    Returns:
        The buffers per activation (absent: one).
    """
    readers = _product_readers(graph)
    extra = input_gradient_partials(graph, products)
    buffers = {}
    for tid in set(extra) | {t for t, count in readers.items() if count > 1}:
        count = readers.get(tid, 0)
        buffers[tid] = max(count, 1) + extra.get(tid, 0) + (count > 1)
    return buffers


def split_sums_of_several_products(
    graph: AxisGraph, products: list[ProductDims]
) -> frozenset[int]:
    """Activations several products read whose input gradients XLA:GPU
    makes in split partials (`input_gradient_partials`) and sums: a gated
    feed-forward's input, read by its gate and up projections. With memory
    free XLA:GPU forms that sum before the layer's weight gradients
    (`accelerator_peak`).

    Args:
        graph: The model's axis graph.
        products: `activation_products` of the candidate sharding.

    Returns:
        The activations' ids.
    """
    readers = _product_readers(graph)
    split = input_gradient_partials(graph, products)
    return frozenset(tid for tid in split if readers[tid] > 1)


def _product_readers(graph: AxisGraph) -> collections.Counter:
    """Activation id -> how many matrix products read it."""
    return collections.Counter(t for pair in graph.matmul_pairs for t in pair)
