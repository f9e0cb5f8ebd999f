"""Which residuals XLA materialises once it has fused elementwise work.

Reads the walk's state (`graph/builder.py`'s builder: the residuals each
equation keeps, which equations are fusible, views, the layer that made
each tensor) and returns the `Kept` list of the axis graph.
"""

from __future__ import annotations

from typing import Any

from keras_autoshard.graph.axis_graph import Kept

# Reductions whose elementwise producers XLA:GPU fuses into them (input
# fusion), and whose results feed the second pass of a normalisation.
REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}
)


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

    Args:
        builder: The walk's `_GraphBuilder`.
        within_layers: Stop fusions at layer-call boundaries.

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
            for root in roots:
                key = (root, scale) if root == tid else (root, 1.0)
                kept[key] = max(kept.get(key, 0), times)
                layers.setdefault(key, set()).update(by_layers)
    return tuple(
        Kept(t, scale, times, tuple(sorted(layers[(t, scale)])))
        for (t, scale), times in sorted(kept.items())
    )


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
    if operands is None:
        return memo[tid]
    if tid in builder.feeds_unfused:
        if not accelerator or not builder.unfused_readers.get(tid, set()) <= REDUCTIONS:
            return memo[tid]
        roots = _operand_roots(builder, tid, operands, memo, within_layers, True)
        if not _second_pass(builder, roots, memo, within_layers):
            return memo[tid]
        memo[tid] = tuple(roots)
        return memo[tid]
    memo[tid] = tuple(
        _operand_roots(builder, tid, operands, memo, within_layers, accelerator)
    )
    return memo[tid]


def _second_pass(builder: Any, roots: list[int], memo, within_layers: bool) -> bool:
    """Whether `roots` hold a reduction's result together with the value
    (or what it is recomputed from) that reduction reduced."""
    held = set(roots)
    for root in roots:
        reduced = builder.reduced_from.get(root)
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
