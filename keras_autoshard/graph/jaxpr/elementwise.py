"""Elementwise, identity, fresh-value and random primitives.

Each rule registers itself for its primitives with `@primitive_rule`.
"""

from __future__ import annotations

import logging

from keras_autoshard.graph.jaxpr.registry import (
    ELEMENTWISE_PRIMITIVES,
    RANDOM_PRIMITIVES,
    primitive_rule,
)
from keras_autoshard.graph.jaxpr.walker import (
    VIEW_PRIMITIVES,
    Eqn,
)

logger = logging.getLogger(__name__)


@primitive_rule(*ELEMENTWISE_PRIMITIVES)
def _rule_elementwise(e: Eqn) -> list[int]:
    outs = e.fresh_outputs()
    for out in outs:
        for operand in e.ins:
            _map_broadcasting_operand(e, operand, out)
    if e.name in VIEW_PRIMITIVES:
        e.builder.record_view(e.ins[0], outs[0])
        _record_cast(e.builder, e.ins[0], outs[0])
    return outs


def _record_cast(builder, operand: int, out: int) -> None:
    """Note `out` as a parameter or activation converted to another
    precision, its shape kept (`AxisGraph.casts`)."""
    source = builder.cast_of.get(operand, operand)
    origin, result = builder.tensors[source], builder.tensors[out]
    same_shape = origin.shape == result.shape
    kinds = ("param", "activation")
    if origin.kind in kinds and same_shape and origin.itemsize != result.itemsize:
        builder.cast_of[out] = source


def _map_broadcasting_operand(e: Eqn, operand: int, out: int) -> None:
    """Unify equal dims; size-1 (or rank-0) operand dims broadcast."""
    in_shape, out_shape = e.shape(operand), e.shape(out)
    if not in_shape:
        broadcast = list(range(len(out_shape)))
    elif len(in_shape) != len(out_shape):
        e.mark_all(operand, f"rank mismatch in {e.name}")
        e.mark_all(out, f"rank mismatch in {e.name}")
        return
    else:
        broadcast = []
        for dim, (in_size, out_size) in enumerate(zip(in_shape, out_shape)):
            if in_size == out_size:
                e.unify(operand, dim, out, dim)
            elif in_size == 1:
                broadcast.append(dim)
            else:
                e.mark(operand, dim, f"dim size mismatch in {e.name}")
                e.mark(out, dim, f"dim size mismatch in {e.name}")
    if e.requires_grad(operand):
        elements = [e.element(out, d) for d in broadcast]
        e.event("broadcast_grad", "backward", elements, operand)


@primitive_rule(
    "optimization_barrier", "device_put", "sharding_constraint", "mesh_cast"
)
def _rule_per_operand_identity(e: Eqn) -> list[int]:
    outs = e.fresh_outputs()
    if len(outs) != len(e.ins):
        return e.walker.unknown(e, f"operand/result count mismatch in {e.name}")
    for operand, out in zip(e.ins, outs):
        e.unify_all(operand, out)
        e.builder.record_view(operand, out)
    return outs


@primitive_rule("iota", "empty", "empty2", "create_token")
def _rule_fresh(e: Eqn) -> list[int]:
    return e.fresh_outputs()


@primitive_rule(*RANDOM_PRIMITIVES)
def _rule_random(e: Eqn) -> list[int]:
    """Elementwise where every non-scalar operand matches the output shape."""
    outs = e.fresh_outputs()
    for out in outs:
        operands = [t for t in e.ins if e.shape(t)]
        if all(e.shape(t) == e.shape(out) for t in operands):
            for operand in operands:
                e.unify_all(operand, out)
    return outs


@primitive_rule("bitcast_convert_type")
def _rule_bitcast_convert_type(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    if e.shape(operand) == e.shape(out):
        e.unify_all(operand, out)
    else:
        e.mark_all(operand, "bitcast_convert_type changing the shape")
        e.mark_all(out, "bitcast_convert_type changing the shape")
    return [out]
