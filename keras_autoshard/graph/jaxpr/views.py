"""Primitives that move, regroup or select dimensions: broadcast, reshape,
transpose, squeeze, rev, slices, pad, concatenate, tile, split, stack.

Each rule registers itself for its primitives with `@primitive_rule`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from keras_autoshard.graph.jaxpr.registry import primitive_rule
from keras_autoshard.graph.jaxpr.walker import (
    Eqn,
)

logger = logging.getLogger(__name__)


@primitive_rule("broadcast_in_dim")
def _rule_broadcast_in_dim(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    mapped = tuple(e.params["broadcast_dimensions"])
    in_shape, out_shape = e.shape(operand), e.shape(out)
    grad_dims = [o for o in range(len(out_shape)) if o not in mapped]
    for in_dim, out_dim in enumerate(mapped):
        if in_shape[in_dim] == out_shape[out_dim]:
            e.unify(operand, in_dim, out, out_dim)
        else:
            grad_dims.append(out_dim)
    if e.requires_grad(operand):
        elements = [e.element(out, d) for d in sorted(grad_dims)]
        e.event("broadcast_grad", "backward", elements, operand)
    e.builder.record_view(operand, out)
    e.builder.broadcast_of[out] = (operand, frozenset(grad_dims))
    return [out]


def _reshape_groups(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]] | None:
    """Group non-1 dims into contiguous runs with equal products (or None)."""
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        group_in, group_out = [ins[i]], [outs[j]]
        prod_in, prod_out = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while prod_in != prod_out:
            if prod_in < prod_out and i < len(ins):
                group_in.append(ins[i])
                prod_in, i = prod_in * in_shape[ins[i]], i + 1
            elif prod_out < prod_in and j < len(outs):
                group_out.append(outs[j])
                prod_out, j = prod_out * out_shape[outs[j]], j + 1
            else:
                return None
        groups.append((group_in, group_out))
    if i != len(ins) or j != len(outs):
        return None
    return groups


@primitive_rule("reshape")
def _rule_reshape(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    in_shape, out_shape = e.shape(operand), e.shape(out)
    if e.params.get("dimensions") is None and 0 in in_shape:
        _map_empty_reshape(e, operand, out)
        return [out]
    groups = _reshape_groups(in_shape, out_shape)
    if e.params.get("dimensions") is not None or groups is None:
        reason = "reshape with no contiguous factorisation"
        e.mark_all(operand, reason)
        e.mark_all(out, reason)
        return [out]
    for group_in, group_out in groups:
        _map_reshape_group(e, operand, out, group_in, group_out)
    e.builder.record_view(operand, out)
    return [out]


def _map_empty_reshape(e: Eqn, operand: int, out: int) -> None:
    """A reshape of an empty tensor moves no elements, and no product of
    sizes tells how its dims regroup (GPT-NeoX's rotary embedding turns the
    first 0 of a head's features when its rotary share rounds down to 0).
    The dims that match at either end are the same dims; the others are
    kept whole."""
    in_shape, out_shape = e.shape(operand), e.shape(out)
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    shorter = min(len(ins), len(outs))
    head = 0
    while head < shorter and in_shape[ins[head]] == out_shape[outs[head]]:
        head += 1
    tail = 0
    while (
        head + tail < shorter and in_shape[ins[-1 - tail]] == out_shape[outs[-1 - tail]]
    ):
        tail += 1
    matched = list(zip(ins[:head], outs[:head]))
    matched += list(zip(ins[len(ins) - tail :], outs[len(outs) - tail :]))
    for in_dim, out_dim in matched:
        e.unify(operand, in_dim, out, out_dim)
    reason = f"reshape {tuple(in_shape)}->{tuple(out_shape)} of an empty tensor"
    for dim in ins[head : len(ins) - tail]:
        e.mark(operand, dim, reason)
    for dim in outs[head : len(outs) - tail]:
        e.mark(out, dim, reason)
    e.builder.record_view(operand, out)


def _map_reshape_group(
    e: Eqn, operand: int, out: int, group_in: list[int], group_out: list[int]
) -> None:
    if len(group_in) == 1 and len(group_out) == 1:
        e.unify(operand, group_in[0], out, group_out[0])
    elif len(group_in) == 1:
        # Split: the major output factor is a block of the input dim.
        e.builder.add_slice_edge(
            (operand, group_in[0]), (out, group_out[0]), "reshape split"
        )
        for dim in group_out[1:]:
            e.mark(out, dim, "minor factor of reshape split")
    elif len(group_out) == 1:
        # Merge: the major input factor is a block of the output dim.
        repeat_source = _repeat_source(e, operand, group_in)
        if repeat_source is not None:
            e.builder.repeat_of[out] = repeat_source
        e.builder.add_slice_edge(
            (operand, group_in[0]),
            (out, group_out[0]),
            "reshape merge" if repeat_source is None else "repeat",
            repeat_source,
        )
        for dim in group_in[1:]:
            e.mark(operand, dim, "minor factor of reshape merge")
    else:
        # Regroup, e.g. (b·s·k, d) -> (b, s, k·d): cutting either major dim
        # into n blocks cuts the flattened group into the same n contiguous
        # pieces whenever n divides both. So a cut operand major dim carries
        # over to the output's, and the output's may be cut alone (each device
        # keeps its block of a whole operand), as for a split; the minor dims
        # stay whole.
        in_sizes = tuple(e.shape(operand)[d] for d in group_in)
        out_sizes = tuple(e.shape(out)[d] for d in group_out)
        reason = f"minor factor of reshape {in_sizes}->{out_sizes}"
        if math.gcd(in_sizes[0], out_sizes[0]) > 1:
            e.builder.add_slice_edge(
                (operand, group_in[0]), (out, group_out[0]), "reshape regroup"
            )
        else:
            reason = f"reshape {in_sizes}->{out_sizes} shares no major factor"
            e.mark(operand, group_in[0], reason)
            e.mark(out, group_out[0], reason)
        for dim in group_in[1:]:
            e.mark(operand, dim, reason)
        for dim in group_out[1:]:
            e.mark(out, dim, reason)


def _repeat_source(e: Eqn, operand: int, group_in: list[int]) -> int | None:
    """The un-repeated tensor when a merge undoes a broadcast (`jnp.repeat`).

    Sharding the merged dim then makes the gradient partial only after the
    broadcast's sum, so the backward all-reduce is on the smaller source.
    """
    source, broadcast_dims = e.builder.broadcast_of.get(operand, (None, frozenset()))
    repeated = set(group_in[1:]) <= broadcast_dims
    if source is None or not repeated or group_in[0] in broadcast_dims:
        return None
    return source


@primitive_rule("transpose")
def _rule_transpose(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    for out_dim, in_dim in enumerate(e.params["permutation"]):
        e.unify(operand, in_dim, out, out_dim)
    e.builder.record_view(operand, out)
    return [out]


@primitive_rule("squeeze")
def _rule_squeeze(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    rank = e.rank(operand)
    removed = {d % rank for d in e.params["dimensions"]}
    kept = [d for d in range(rank) if d not in removed]
    for out_dim, in_dim in enumerate(kept):
        e.unify(operand, in_dim, out, out_dim)
    e.builder.record_view(operand, out)
    return [out]


@primitive_rule("rev")
def _rule_same_shape(e: Eqn) -> list[int]:
    """rev and friends: output dims are the operand dims, reordered in place."""
    operand, out = e.ins[0], e.fresh_outputs()[0]
    e.unify_all(operand, out)
    return [out]


@primitive_rule("slice")
def _rule_slice(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    strides = e.params.get("strides") or (1,) * e.rank(operand)
    for dim, (size, out_size, stride) in enumerate(
        zip(e.shape(operand), e.shape(out), strides)
    ):
        if size == out_size and stride == 1:
            e.unify(operand, dim, out, dim)
        else:
            e.slice_edge(operand, dim, out, dim)
    return [out]


@primitive_rule("dynamic_slice")
def _rule_dynamic_slice(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    for dim, (size, out_size) in enumerate(zip(e.shape(operand), e.shape(out))):
        if size == out_size:
            e.unify(operand, dim, out, dim)
        else:
            e.slice_edge(operand, dim, out, dim)
    return [out]


@primitive_rule("dynamic_update_slice")
def _rule_dynamic_update_slice(e: Eqn) -> list[int]:
    operand, update, out = e.ins[0], e.ins[1], e.fresh_outputs()[0]
    reason = "updated dim of dynamic_update_slice"
    for dim, (size, update_size) in enumerate(zip(e.shape(operand), e.shape(update))):
        e.unify(operand, dim, out, dim)
        if size == update_size:
            e.unify(update, dim, out, dim)
        else:
            e.mark(out, dim, reason)
            e.mark(update, dim, reason)
    return [out]


@primitive_rule("pad")
def _rule_pad(e: Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    for dim, config in enumerate(e.params["padding_config"]):
        if tuple(int(c) for c in config) == (0, 0, 0):
            e.unify(operand, dim, out, dim)
        else:
            e.slice_edge(operand, dim, out, dim)
    return [out]


@primitive_rule("concatenate")
def _rule_concatenate(e: Eqn) -> list[int]:
    """Parts of equal size joined along the leading dim (two batches, real
    and generated) keep their cuts (`Eqn.joined_edge`); others (a row
    appended, halves of a feature rotated back together) stay whole."""
    out = e.fresh_outputs()[0]
    axis = e.params["dimension"]
    equal = axis == 0 and len({e.shape(operand)[axis] for operand in e.ins}) == 1
    for operand in e.ins:
        for dim in range(e.rank(out)):
            if dim == axis:
                edge = e.joined_edge if equal else e.slice_edge
                edge(operand, dim, out, dim)
            else:
                e.unify(operand, dim, out, dim)
    return [out]


@primitive_rule("tile")
def _rule_tile(e: Eqn) -> list[int]:
    """Repeats of a dim of size 1 broadcast it (a class token tiled to the
    batch): the new dim is free, as for `broadcast_in_dim`. Repeats of a
    larger dim select positions of the operand (a slice edge)."""
    operand, out = e.ins[0], e.fresh_outputs()[0]
    broadcast_dims = []
    for dim, reps in enumerate(e.params["reps"]):
        if reps == 1:
            e.unify(operand, dim, out, dim)
        elif e.shape(operand)[dim] == 1:
            broadcast_dims.append(dim)
        else:
            e.slice_edge(operand, dim, out, dim)
    if broadcast_dims and e.requires_grad(operand):
        elements = [e.element(out, d) for d in broadcast_dims]
        e.event("broadcast_grad", "backward", elements, operand)
    return [out]


@primitive_rule("split")
def _rule_split(e: Eqn) -> list[int]:
    operand, outs = e.ins[0], e.fresh_outputs()
    axis = e.params["axis"] % e.rank(operand)
    # Equal parts of the leading dim (a batch split back in two) stay
    # cuttable, as for `concatenate`.
    equal = axis == 0 and len({e.shape(out)[axis] for out in outs}) == 1
    for out in outs:
        for dim in range(e.rank(operand)):
            if dim == axis:
                edge = e.joined_edge if equal else e.slice_edge
                edge(operand, dim, out, dim)
            else:
                e.unify(operand, dim, out, dim)
    return outs


@primitive_rule("stack")
def _rule_stack(e: Eqn) -> list[int]:
    out = e.fresh_outputs()[0]
    axis = e.params["axis"] % e.rank(out)
    kept = [d for d in range(e.rank(out)) if d != axis]
    for operand in e.ins:
        for in_dim, out_dim in enumerate(kept):
            e.unify(operand, in_dim, out, out_dim)
    e.mark(out, axis, "stacked dim of stack")
    return [out]


@primitive_rule("unstack")
def _rule_unstack(e: Eqn) -> list[int]:
    operand, outs = e.ins[0], e.fresh_outputs()
    axis = e.params["axis"] % e.rank(operand)
    kept = [d for d in range(e.rank(operand)) if d != axis]
    e.mark(operand, axis, "unstacked dim of unstack")
    for out in outs:
        for out_dim, in_dim in enumerate(kept):
            e.unify(operand, in_dim, out, out_dim)
    return outs
