"""Contractions: dot_general and convolutions.

Each rule registers itself for its primitives with `@primitive_rule`.
"""

from __future__ import annotations

import logging

from keras_autoshard.graph.axis_graph import GroupedConv
from keras_autoshard.graph.jaxpr.reductions import free_dims
from keras_autoshard.graph.jaxpr.registry import primitive_rule
from keras_autoshard.graph.jaxpr.walker import (
    Eqn,
)

logger = logging.getLogger(__name__)


@primitive_rule("dot_general")
def _rule_dot_general(e: Eqn) -> list[int]:
    lhs, rhs, out = e.ins[0], e.ins[1], e.fresh_outputs()[0]
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = e.params["dimension_numbers"]
    lhs_free = free_dims(e.rank(lhs), lhs_contract, lhs_batch)
    rhs_free = free_dims(e.rank(rhs), rhs_contract, rhs_batch)
    out_dim = 0
    for lhs_dim, rhs_dim in zip(lhs_batch, rhs_batch):
        e.unify(lhs, lhs_dim, out, out_dim)
        e.unify(rhs, rhs_dim, out, out_dim)
        out_dim += 1
    lhs_free_out = list(range(out_dim, out_dim + len(lhs_free)))
    rhs_free_out = list(range(out_dim + len(lhs_free), e.rank(out)))
    for in_dim, o in zip(lhs_free, lhs_free_out):
        e.unify(lhs, in_dim, out, o)
    for in_dim, o in zip(rhs_free, rhs_free_out):
        e.unify(rhs, in_dim, out, o)
    for lhs_dim, rhs_dim in zip(lhs_contract, rhs_contract):
        e.unify(lhs, lhs_dim, rhs, rhs_dim)
    e.event("contract", "forward", [e.element(lhs, d) for d in lhs_contract], out)
    e.builder.note_matmul_operands(lhs, rhs)
    view_of = e.builder.view_of
    pair = (view_of.get(lhs, lhs), view_of.get(rhs, rhs))
    e.builder.matmul_pairs[pair] = None
    if not lhs_batch:
        e.builder.unbatched_products[out] = (*pair, len(lhs_free))
    if _rewritten(e.rank(lhs), e.rank(rhs), lhs_contract, lhs_batch, rhs_batch):
        for tid, order in (
            (lhs, (*lhs_batch, *lhs_free, *lhs_contract)),
            (rhs, (*rhs_batch, *rhs_contract, *rhs_free)),
        ):
            if _moves_data(e.shape(tid), order):
                e.builder.relaid_operands.add(tid)
    if e.builder.is_activation(lhs) and e.builder.is_activation(rhs):
        e.builder.activation_products.append((lhs, rhs, out))
    if e.requires_grad(lhs):
        e.event("contract", "backward", [e.element(out, o) for o in rhs_free_out], lhs)
    if e.requires_grad(rhs):
        e.event("contract", "backward", [e.element(out, o) for o in lhs_free_out], rhs)
    return [out]


def _rewritten(lhs_rank, rhs_rank, contract, lhs_batch, rhs_batch) -> bool:
    """Whether XLA rewrites a product before multiplying (its
    `DotDecomposer`): every one but a canonical dot (one contracting dim,
    at most one free dim per operand, batch dims leading in order). It
    transposes the operands of those it rewrites, the lhs to (batch, free,
    contracting) and the rhs to (batch, contracting, free), contracting
    dims in the order the product lists them."""
    leading = tuple(range(len(lhs_batch)))
    return (
        len(contract) != 1
        or max(lhs_rank, rhs_rank) > len(lhs_batch) + 2
        or tuple(lhs_batch) != leading
        or tuple(rhs_batch) != leading
    )


def _moves_data(shape: tuple[int, ...], order: tuple[int, ...]) -> bool:
    """Whether transposing a row-major buffer of `shape` to `order` moves
    its data (a copy), not only its labels: the dims of size > 1 change
    their order."""
    kept = [d for d in order if shape[d] != 1]
    return kept != sorted(kept)


@primitive_rule("conv_general_dilated")
def _rule_conv(e: Eqn) -> list[int]:
    lhs, rhs, out = e.ins[0], e.ins[1], e.fresh_outputs()[0]
    dn = e.params["dimension_numbers"]
    lhs_batch, lhs_feature, *lhs_spatial = dn.lhs_spec
    rhs_out, rhs_in, *rhs_spatial = dn.rhs_spec
    out_batch, out_feature, *out_spatial = dn.out_spec
    for tid, dims in ((lhs, lhs_spatial), (rhs, rhs_spatial), (out, out_spatial)):
        for dim in dims:
            e.mark(tid, dim, f"spatial dim of {e.name}")
    if e.params.get("batch_group_count", 1) == 1:
        e.unify(lhs, lhs_batch, out, out_batch)
    else:
        e.mark(lhs, lhs_batch, f"batch_group_count > 1 in {e.name}")
        e.mark(out, out_batch, f"batch_group_count > 1 in {e.name}")
    groups = e.params.get("feature_group_count", 1)
    if groups != 1:
        e.builder.grouped_convs.append(GroupedConv(lhs, lhs_feature, e.layer))
    channels = (e.shape(lhs)[lhs_feature], e.shape(out)[out_feature])
    if groups != 1 and channels == (groups, groups):
        # Depthwise (one input and one output channel per group): a block of
        # channels is a block of whole groups, computed locally.
        e.unify(lhs, lhs_feature, out, out_feature)
        e.unify(rhs, rhs_out, out, out_feature)
        e.mark(rhs, rhs_in, f"grouped {e.name}")
    elif groups != 1 or e.params.get("batch_group_count", 1) != 1:
        reason = f"grouped {e.name}"
        for tid, dim in ((lhs, lhs_feature), (rhs, rhs_in), (rhs, rhs_out)):
            e.mark(tid, dim, reason)
        e.mark(out, out_feature, reason)
    else:
        e.unify(lhs, lhs_feature, rhs, rhs_in)
        e.unify(rhs, rhs_out, out, out_feature)
    e.event("contract", "forward", [e.element(lhs, lhs_feature)], out)
    e.builder.note_matmul_operands(lhs, rhs)
    if e.requires_grad(lhs):
        e.event("contract", "backward", [e.element(rhs, rhs_out)], lhs)
    if e.requires_grad(rhs):
        e.event("contract", "backward", [e.element(lhs, lhs_batch)], rhs)
    return [out]
