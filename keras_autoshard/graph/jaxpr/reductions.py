"""Reductions and ops along one axis: reduce_*, argmin/argmax, cumulative
ops, sort, top_k, reduce_window.

Each rule registers itself for its primitives with `@primitive_rule`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from keras_autoshard.graph.jaxpr.registry import primitive_rule
from keras_autoshard.graph.jaxpr.walker import (
    Eqn,
)

logger = logging.getLogger(__name__)


def free_dims(rank: int, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
    used = set(contract) | set(batch)
    return [d for d in range(rank) if d not in used]


def _map_reduction(
    e: Eqn, operand: int, out: int, axes: Sequence[int]
) -> list[int | None]:
    """Unify kept dims with the output; return the reduced dims' elements."""
    rank = e.rank(operand)
    reduced = {a % rank for a in axes}
    kept = [d for d in range(rank) if d not in reduced]
    for out_dim, in_dim in enumerate(kept):
        e.unify(operand, in_dim, out, out_dim)
    return [e.element(operand, d) for d in sorted(reduced)]


@primitive_rule(
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
)
def _rule_reduce(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    reduced = _map_reduction(e, operand, out, e.params["axes"])
    e.event("reduce", "forward", reduced, out)
    return [out]


@primitive_rule("reduce")
def _rule_variadic_reduce(e: Eqn) -> list[int]:
    outs = e.fresh_outputs()
    for operand, out in zip(e.ins[: len(outs)], outs):
        reduced = _map_reduction(e, operand, out, e.params["dimensions"])
        e.event("reduce", "forward", reduced, out)
    return outs


@primitive_rule("argmax", "argmin")
def _rule_argminmax(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    axes = e.params["axes"]
    _map_reduction(e, operand, out, axes)
    for axis in axes:
        e.mark(operand, axis % e.rank(operand), f"reduced dim of {e.name}")
    return [out]


@primitive_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _rule_cumulative(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    e.unify_all(operand, out)
    e.mark(operand, e.params["axis"] % e.rank(operand), f"scanned dim of {e.name}")
    return [out]


@primitive_rule("sort")
def _rule_sort(e: Eqn) -> list[int]:
    outs = e.fresh_outputs()
    first = e.ins[0]
    for tid in [*e.ins[1:], *outs]:
        e.unify_all(first, tid)
    e.mark(first, e.params["dimension"] % e.rank(first), "sorted dim of sort")
    return outs


@primitive_rule("top_k")
def _rule_top_k(e: Eqn) -> list[int]:
    operand, outs = e.ins[0], e.fresh_outputs()
    rank = e.rank(operand)
    axis = e.params.get("axis", -1) % rank
    for out in outs:
        for dim in range(rank):
            if dim == axis:
                e.mark(out, dim, "top_k dim of top_k")
            else:
                e.unify(operand, dim, out, dim)
    e.mark(operand, axis, "top_k dim of top_k")
    return outs


@primitive_rule(
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window"
)
def _rule_reduce_window(e: Eqn) -> list[int]:
    outs = e.fresh_outputs()
    p = e.params
    windows = zip(
        p["window_dimensions"],
        p["window_strides"],
        p["padding"],
        p["base_dilation"],
    )
    for dim, (size, stride, padding, dilation) in enumerate(windows):
        untouched = size == 1 and stride == 1 and dilation == 1
        untouched = untouched and tuple(padding) == (0, 0)
        for operand, out in zip(e.ins[: len(outs)], outs):
            if untouched:
                e.unify(operand, dim, out, dim)
            else:
                e.mark(operand, dim, f"window dim of {e.name}")
                e.mark(out, dim, f"window dim of {e.name}")
    return outs
