"""Which residuals XLA materialises once it has fused elementwise work.

Reads the walk's state (`graph/walk_state.py`'s builder: the residuals each
equation keeps, which equations are fusible, views, the layer that made
each tensor) and returns the `Kept` list of the axis graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from keras_autoshard.graph.axis_graph import Kept

# Reductions whose elementwise producers XLA:GPU fuses into them (input
# fusion), and whose results feed the second pass of a normalisation.
REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}
)


# Elementwise primitives whose output XLA:GPU materialises, by the bytes of
# an element of that output, rather than compute it again in the backward
# pass's fusion from the values it was made of (its cost model does not
# duplicate them). Read off XLA:GPU's buffers by
# `python -m benchmarks.fusion_probe` (H100 target):
# a residual stack whose layers compute `x * f(x)` keeps one more buffer of
# f(x) per layer for these (lgamma 3 to 5 more, counted as one); for erf,
# exp, logistic, log, expm1, tan, sinh, asinh, sqrt, rsqrt, division and
# cbrt, and float32 tanh, erfc, log1p and atan, it keeps none. `pow` is
# kept too with the probe's exponent 0.7 but left out: XLA rewrites a
# constant exponent 2 (a Llama RMSNorm's `power(x, 2)`) as a product, which
# is computed again.
MATERIALISED_ON_ACCELERATORS = {
    2: frozenset({"atan", "cos", "erf_inv", "erfc", "lgamma", "log1p", "sin", "tanh"}),
    4: frozenset({"cos", "erf_inv", "lgamma", "sin"}),
}
# Of those, the ones whose operand the forward fusion emits too, for the
# derivative (`exp(-u^2)` of `erfc(u)`): a Keras exact GELU after a biased
# Dense keeps `u = -x / sqrt(2)` beside `erfc(u)` (ViT-22B widths; the
# stack in `tests/planner/test_residual_fusion_gpu.py`). Not measured for the others.
OPERAND_EMITTED = frozenset({"erfc"})


# Elementwise primitives XLA does not count as expensive
# (`HloInstruction::IsExpensive`): fused into every consumer, reductions
# included, and computed again in each rather than materialised. Read off
# XLA:GPU's program of Mixtral-8x7B widths on 8x8 under `mixed_bfloat16`:
# the attention's masked float32 scores (a `select_n` of the bfloat16
# product's float32 cast), read by the softmax's maximum, are not kept;
# the bfloat16 product is (1 GiB a layer where 2 GiB were counted).
CHEAP = frozenset(
    {
        "abs", "add", "and", "ceil", "clamp", "convert_element_type", "copy",
        "eq", "floor", "ge", "gt", "le", "lt", "max", "min", "mul", "ne",
        "neg", "not", "or", "round", "select_n", "sign", "sub", "xor",
    }
)  # fmt: skip


# Elementwise primitives XLA counts as expensive (`HloInstruction::IsExpensive`,
# by their JAX names). Where one reads a split product's sum in the fusible
# work after it (a GELU's tanh), XLA:GPU keeps fewer of the product's
# partials for the backward pass than where only cheap work does (a ReLU's
# `max`): `expensively_read_products`, `planner/split_k.py`.
EXPENSIVE = frozenset(
    {
        "atan2", "cbrt", "cos", "div", "erf", "erf_inv", "erfc", "exp", "exp2",
        "expm1", "log", "log1p", "logistic", "pow", "rem", "rsqrt", "sin",
        "sqrt", "tan", "tanh",
    }
)  # fmt: skip


# Activations whose derivative reads their output, which XLA:GPU computes
# again in the backward pass's fusion from a split product's partial
# results (their sum, the bias and the activation) rather than keep: read
# off XLA:GPU's program of the zoo's tied model on 2x4, whose tanh Dense
# keeps its four float32 partials to the backward pass, and of a model
# written in `tests/planner/test_backward_buffers_gpu.py`.
RECOMPUTED_ACTIVATIONS = frozenset({"tanh"})


# Relabels XLA:GPU fuses with the elementwise work on either side: a value
# read only through them is computed again where its readers are, as if
# they read it directly. Read off XLA:GPU's buffers of a Llama at
# Llama-2-70B widths on 16x16 under `mixed_bfloat16` (4 layers, none
# rematerialized): the attention's boolean mask, made from the padding
# mask and broadcast over the heads, reaches the softmax's `select_n`
# through a transpose and is not kept (256 MiB a layer were counted; no
# buffer of its size is live at the compiled peak).
FUSED_RELABELS = frozenset({"transpose"})


def note_fusion(
    builder: Any,
    name: str,
    fusible: bool,
    ins: Sequence[int],
    outs: Sequence[int],
    params: dict | None = None,
) -> None:
    """Record what the fusion rules read of one equation (`name`, reading
    `ins`, making `outs`, with `params`) in the walk's state: a fusible
    equation's outputs are made from `ins` by `name`; an unfusible one
    reads `ins` (and the sources of the views among them); a reduction's
    output reduces its first operand over the dims its `axes` name."""
    if fusible:
        for tid in outs:
            builder.fused_from[tid] = tuple(ins)
            builder.made_by[tid] = name
        return
    for tid in ins:
        builder.unfused_readers.setdefault(tid, set()).add(name)
        if tid in builder.view_of:
            readers = builder.readers_through_views
            readers.setdefault(builder.view_of[tid], set()).add(name)
    if name in REDUCTIONS and ins and outs:
        builder.reduced_from[outs[0]] = ins[0]
        builder.reduced_axes[outs[0]] = tuple((params or {}).get("axes", ()))


def kept_after_fusion(
    builder: Any, within_layers: bool = False, accelerator: bool = False
) -> tuple[Kept, ...]:
    """The residuals XLA materialises.

    With `within_layers`, a fusion does not reach past the call of the
    layer that made the residual: what another layer call made is kept
    as it is. That is the rematerialized program's view (a checkpointed
    call's output is materialised), where the whole-program view would
    have the last norm of a backbone recompute its input from the
    residual stream of every layer.

    XLA fuses elementwise work into its consumers, in the backward pass
    too: a residual made by elementwise equations from other values and
    read by elementwise derivative work only (the sigmoid inside a SiLU,
    a normalised activation before its scale) is recomputed inside the
    backward fusion from the values it was made of, which are kept
    instead. Values an unfusible equation reads (a matmul's operands)
    or makes (its output, a reduction's) are materialised as they are.

    With `accelerator` (XLA:GPU's program), more rules, each read off
    XLA:GPU's buffers: a max pooling keeps the positions of its maxima
    (`_pooling_indices`); what a matmul reads through a copy or reshape is
    materialised; a transpose is fused with what it reads and what reads it
    (`FUSED_RELABELS`); a value read only by reductions is fused into them when
    it is a normalisation's second pass or a widening cast; the outputs of
    `MATERIALISED_ON_ACCELERATORS` are kept as they are, with the operands
    `OPERAND_EMITTED` ones read in their derivative.

    Args:
        builder: The walk's `GraphBuilder`.
        within_layers: Stop fusions at layer-call boundaries.
        accelerator: Apply XLA:GPU's rules (above).

    Returns:
        One `Kept` per materialised residual, sorted by tensor id.
    """
    kept: dict[tuple[int, float], int] = {}
    layers: dict[tuple[int, float], set[str]] = {}
    roots_of: dict[int, tuple[int, ...]] = {}
    producer = builder.layers.producer
    for (tid, scale), times in builder.residuals.items():
        keeping = builder.residual_layers[(tid, scale)]
        made_in = producer.get(builder.view_of.get(tid, tid))
        groups = [keeping]
        if within_layers:
            # Another layer call's output is materialised as it is.
            groups = [g for g in (keeping - {made_in}, keeping & {made_in}) if g]
        for by_layers in groups or [keeping]:
            roots = (
                (tid,)
                if within_layers and made_in not in by_layers
                else _fusion_roots(builder, tid, roots_of, within_layers, accelerator)
            )
            if accelerator:
                roots = (*roots, *_emitted_operands(builder, tuple(roots)))
            for root in roots:
                key = (root, scale) if root == tid else (root, 1.0)
                kept[key] = max(kept.get(key, 0), times)
                layers.setdefault(key, set()).update(by_layers)
    found = tuple(
        Kept(t, scale, times, tuple(sorted(layers[(t, scale)])))
        for (t, scale), times in sorted(kept.items())
    )
    return found + (_pooling_indices(builder) if accelerator else ())


def _pooling_indices(builder: Any) -> tuple[Kept, ...]:
    """What XLA:GPU keeps from the forward pass for a max pooling of a ReLU:
    it makes the ReLU's zero operand and the backward scatter's zero start
    as one broadcast and holds the ReLU's copy, one more buffer of the
    input's size, from the forward pass on. The positions of each window's
    extremum (one int32 array of the output's shape per input dim, which
    the backward scatter reads) are not kept from the forward pass:
    XLA:GPU's scheduler runs the reduce-window that emits them as late as
    it can, at the end of the forward pass or in the backward pass just
    before the scatter (the zoo's CNN on 2x4 under `mixed_bfloat16`: after
    the Dense layers' backward pass), so `accelerator_peak` counts them at
    the pooling's stage. Read off XLA:GPU's buffers: a convolution, a
    pooling and a Dense on 8x1 and 2x4 (`tests/planner/test_pooling_gpu.py`)."""
    kept = []
    for source, (_, layer) in sorted(builder.poolings.items()):
        if source in builder.constant_like:
            continue
        if not math.prod(builder.shape(source)) * builder.tensors[source].itemsize:
            continue
        relu = builder.made_by.get(source) == "max" and any(
            builder.tensors[t].kind == "constant" or t in builder.constant_like
            for t in builder.fused_from.get(source, ())
        )
        if relu:
            kept.append(Kept(source, 1.0, 1, (layer,)))
    return tuple(kept)


def _fusion_roots(
    builder: Any,
    tid: int,
    memo: dict[int, tuple[int, ...]],
    within_layers: bool,
    accelerator: bool = False,
) -> tuple[int, ...]:
    """The materialised values `tid` is recomputed from (itself if it is
    materialised)."""
    if tid in memo:
        return memo[tid]
    memo[tid] = (tid,)  # a cycle guard; loops do not occur in a jaxpr
    operands = builder.fused_from.get(tid)
    if operands is None or (accelerator and _materialised(builder, tid)):
        return memo[tid]
    readers = builder.unfused_readers.get(tid, set())
    if accelerator:
        # XLA:GPU materialises what a matmul reads through a copy or a
        # reshape (a Keras exact GELU's output is copied before the next
        # Dense reads it). The XLA:CPU path leaves it out: counting it there
        # put the zoo's mlp on 1x8 at 1.19 of its compiled peak.
        readers = (
            readers | builder.readers_through_views.get(tid, set())
        ) - FUSED_RELABELS
    if readers:
        if not accelerator or not readers <= REDUCTIONS:
            return memo[tid]
        roots = _operand_roots(builder, tid, operands, memo, within_layers, True)
        if not (
            builder.made_by.get(tid) in CHEAP
            or _widening_cast(builder, tid)
            or _second_pass(builder, roots, memo, within_layers)
        ):
            return memo[tid]
        memo[tid] = tuple(roots)
        return memo[tid]
    memo[tid] = tuple(
        _operand_roots(builder, tid, operands, memo, within_layers, accelerator)
    )
    return memo[tid]


def cast_pairs(builder: Any) -> tuple[tuple[int, int], ...]:
    """`(cast, source)` of every precision cast (`AxisGraph.casts`): a
    parameter's own; of an activation's that a matrix product reads (one
    that only elementwise work reads is fused into it), the materialised
    value of its shape that XLA:GPU's fusion recomputes it from (the
    attention scores' product behind the probabilities cast to bfloat16:
    the backward fusion reads the cast's gradient and writes the
    product's)."""
    pairs, memo = {}, {}
    read = {builder.view_of.get(t, t) for t in builder.matmul_operands}
    for cast, source in builder.cast_of.items():
        if builder.tensors[source].kind == "activation":
            if cast not in read:  # fused into its elementwise readers
                continue
            shape = builder.tensors[cast].shape
            roots = _fusion_roots(builder, source, memo, False, accelerator=True)
            same = [r for r in roots if builder.tensors[r].shape == shape]
            source = max(
                same, key=lambda r: builder.tensors[r].itemsize, default=source
            )
        pairs[cast] = source
    return tuple(sorted(pairs.items()))


def _materialised(builder: Any, tid: int) -> bool:
    """Whether XLA:GPU keeps `tid`, an elementwise output, as it is
    (`MATERIALISED_ON_ACCELERATORS`)."""
    itemsize = builder.tensors[tid].itemsize
    made_by = builder.made_by.get(tid, "")
    return made_by in MATERIALISED_ON_ACCELERATORS.get(itemsize, ())


def _emitted_operands(builder: Any, roots: tuple[int, ...]) -> list[int]:
    """Operands the forward fusion emits beside a materialised output whose
    derivative reads them (`OPERAND_EMITTED`)."""
    emitted: list[int] = []
    for root in roots:
        if builder.made_by.get(root) not in OPERAND_EMITTED:
            continue
        if not _materialised(builder, root):
            continue
        for operand in builder.fused_from[root]:
            operand = builder.view_of.get(operand, operand)
            tensor = builder.tensors[operand]
            if (
                tensor.shape == builder.tensors[root].shape
                and builder.is_activation(operand)
                and operand not in roots
                and operand not in emitted
            ):
                emitted.append(operand)
    return emitted


def _widening_cast(builder: Any, tid: int) -> bool:
    """Whether `tid` casts its one operand to a wider type (a LayerNorm's
    float32 input under `mixed_bfloat16`): fused into the reductions that
    read it and cast again where the backward pass reads it, keeping the
    narrower operand (XLA:GPU at ViT-22B widths keeps the bfloat16 residual
    stream, no float32 copy)."""
    if builder.made_by.get(tid) != "convert_element_type":
        return False
    (operand,) = builder.fused_from[tid]
    return builder.tensors[operand].itemsize < builder.tensors[tid].itemsize


def _reduced_behind(builder: Any, root: int) -> int | None:
    """The operand of the reduction `root` is, or is made from alone by
    elementwise work with constants and relabels (a softmax's maximum,
    clamped and transposed before it is subtracted)."""
    for _ in range(len(builder.tensors)):
        if root in builder.reduced_from:
            return builder.reduced_from[root]
        if root in builder.view_of:
            root = builder.view_of[root]
            continue
        operands = [
            t
            for t in builder.fused_from.get(root, ())
            if t not in builder.constant_like
        ]
        if len(operands) != 1:
            return None
        root = operands[0]
    return None


def _second_pass(builder: Any, roots: list[int], memo, within_layers: bool) -> bool:
    """Whether `roots` hold a reduction's result (or a value made from it
    alone) together with the value (or what it is recomputed from) that
    reduction reduced."""
    held = set(roots)
    for root in roots:
        reduced = _reduced_behind(builder, root)
        if reduced is None:
            continue
        reduced = builder.view_of.get(reduced, reduced)
        if reduced in held or held.intersection(
            _fusion_roots(builder, reduced, memo, within_layers, True)
        ):
            return True
    return False


def _operand_roots(
    builder: Any,
    tid: int,
    operands,
    memo: dict[int, tuple[int, ...]],
    within_layers: bool,
    accelerator: bool,
) -> list[int]:
    """The materialised values the operands of `tid`'s equation come from."""
    roots: list[int] = []
    producer = builder.layers.producer
    for operand in operands:
        if (
            operand in builder.constant_like
            or builder.tensors[operand].kind != "activation"
        ):
            continue  # constants fold; parameters and inputs are resident
        root_view = builder.view_of.get(operand, operand)
        if within_layers and producer.get(root_view) != producer.get(tid):
            if root_view not in roots:
                roots.append(root_view)
            continue
        for root in _fusion_roots(builder, root_view, memo, within_layers, accelerator):
            if root not in roots:
                roots.append(root)
    return roots


def _fused_readers(builder: Any) -> dict[int, list[int]]:
    """Tensor id (a view's source for a view) -> the fusible equations'
    outputs that read it."""
    fused_readers: dict[int, list[int]] = {}
    for out, ins in builder.fused_from.items():
        for tid in ins:
            fused_readers.setdefault(builder.view_of.get(tid, tid), []).append(out)
    return fused_readers


def _reaches(
    builder: Any,
    fused_readers: dict[int, list[int]],
    start: int,
    primitives: frozenset[str],
) -> bool:
    """Whether the fusible work after `start` (followed through every
    elementwise step up to the next unfusible equation) makes a value by
    one of `primitives`."""
    seen, todo = {start}, [start]
    while todo:
        tid = todo.pop()
        if builder.made_by.get(tid) in primitives:
            return True
        for reader in fused_readers.get(tid, ()):
            if reader not in seen:
                seen.add(reader)
                todo.append(reader)
    return False


def expensively_read_products(builder: Any) -> tuple[int, ...]:
    """`AxisGraph.expensively_read_products`: each unbatched product whose
    output the fusible work after it turns by an `EXPENSIVE` primitive
    (`_reaches`): a GELU's input (its tanh), not a ReLU's (its `max`)."""
    fused_readers = _fused_readers(builder)
    return tuple(
        out
        for out in sorted(builder.unbatched_products)
        if _reaches(builder, fused_readers, out, EXPENSIVE)
    )


def product_images(builder: Any) -> tuple[tuple[int, tuple[int, ...], bool], ...]:
    """`AxisGraph.fused_products`: each unbatched product whose output no
    unfusible equation reads (directly or through a view), its images
    (values made from it by `CHEAP` equations whose other operands are
    smaller, broadcast along it: a bias added), and whether the backward
    pass needs it as it is or as an image (a GELU's input, a gate's, the
    output of a `RECOMPUTED_ACTIVATIONS` activation of one; not
    a product kept only as what a fused value downstream is recomputed
    from, such as a residual sum a norm reads, which XLA:GPU materialises).

    Left out too: a product whose elementwise readers lead to an
    `OPERAND_EMITTED` equation (an exact GELU's `erfc`: the forward fusion
    emits the biased product beside it, and the backward pass reads that).
    """
    fused_readers = _fused_readers(builder)
    needed = {builder.view_of.get(tid, tid) for tid, _ in builder.residuals}

    def size(tid: int) -> int:
        return math.prod(builder.tensors[tid].shape)

    def images(start: int) -> tuple[int, ...]:
        found, todo = [], [start]
        while todo:
            tid = todo.pop()
            for reader in fused_readers.get(tid, ()):
                others = [t for t in builder.fused_from[reader] if t != tid]
                if reader in found:
                    continue
                made_by = builder.made_by.get(reader)
                if made_by in RECOMPUTED_ACTIVATIONS and not others:
                    found.append(reader)  # an end: computed again, not read on
                elif made_by in CHEAP and all(size(t) < size(tid) for t in others):
                    found.append(reader)
                    todo.append(reader)
        return tuple(found)

    fused = []
    for out in sorted(builder.unbatched_products):
        if out in builder.unfused_readers or out in builder.readers_through_views:
            continue
        made = images(out)
        if not _reaches(builder, fused_readers, out, OPERAND_EMITTED):
            fused.append((out, made, bool(needed.intersection((out, *made)))))
    return tuple(fused)


def norm_read_products(
    builder: Any, fused_products: Sequence[tuple[int, tuple[int, ...], bool]]
) -> tuple[tuple[int, int, tuple[tuple[int, int], ...], bool], ...]:
    """`AxisGraph.norm_read_products` before its dims become classes: each
    of `fused_products` (`product_images`) whose one reader is a
    residual sum (an `add` of an operand of the product's shape), that sum,
    the `(tensor, dim)` pairs the reductions after it reduce (a norm's
    mean of squares, through fusible work of the sum's shape, up to the
    next such sum), and whether the sum's other operand is itself such a
    sum (a residual stream's second sum on: its first adds the stream's
    input)."""
    fused_readers = _fused_readers(builder)
    reductions: dict[int, list[int]] = {}
    for out, source in builder.reduced_from.items():
        reductions.setdefault(builder.view_of.get(source, source), []).append(out)
    fused = {out for out, _, _ in fused_products}
    sums: dict[int, tuple[int, int]] = {}  # sum -> (product, other operand)
    for out in sorted(fused):
        readers = fused_readers.get(out, ())
        if len(readers) != 1 or builder.made_by.get(readers[0]) != "add":
            continue
        operands = [builder.view_of.get(t, t) for t in builder.fused_from[readers[0]]]
        others = [t for t in operands if t != out]
        if len(others) == 1 and builder.shape(others[0]) == builder.shape(out):
            sums[readers[0]] = (out, others[0])

    def reduced(start: int) -> list[tuple[int, int]]:
        found, seen, todo = [], {start}, [start]
        while todo:
            tid = todo.pop()
            for reduction in reductions.get(tid, ()):
                found.extend((tid, d) for d in builder.reduced_axes.get(reduction, ()))
            for reader in fused_readers.get(tid, ()):
                same = builder.shape(reader) == builder.shape(start)
                if reader not in seen and reader not in sums and same:
                    seen.add(reader)
                    todo.append(reader)
        return found

    return tuple(
        (out, total, tuple(reduced(total)), other in sums)
        for total, (out, other) in sums.items()
    )
