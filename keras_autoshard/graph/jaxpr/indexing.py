"""Gather and scatter.

Each rule registers itself for its primitives with `@primitive_rule`.
"""

from __future__ import annotations

import logging
from typing import Any

from keras_autoshard.graph.jaxpr.registry import primitive_rule
from keras_autoshard.graph.jaxpr.walker import (
    Eqn,
)

logger = logging.getLogger(__name__)


@primitive_rule("gather")
def _rule_gather(e: Eqn) -> list[int]:
    operand, indices, out = e.ins[0], e.ins[1], e.fresh_outputs()[0]
    dn = e.params["dimension_numbers"]
    index_batch = list(range(e.rank(indices) - 1))
    out_batch = [d for d in range(e.rank(out)) if d not in dn.offset_dims]
    if len(index_batch) != len(out_batch):
        return e.walker.unknown(e, "gather with unmapped batch dims")
    for index_dim, out_dim in zip(index_batch, out_batch):
        e.unify(indices, index_dim, out, out_dim)
    for operand_dim, index_dim in zip(
        dn.operand_batching_dims, dn.start_indices_batching_dims
    ):
        e.unify(operand, operand_dim, indices, index_dim)
    _map_gather_windows(e, operand, out, dn)
    _mark_index_vector_dim(e, indices)
    indexed = [d for d in dn.start_index_map if d in dn.collapsed_slice_dims]
    e.event("gather", "forward", [e.element(operand, d) for d in indexed], out)
    if e.requires_grad(operand):
        scattered = [
            e.element(indices, d)
            for d in index_batch
            if d not in dn.start_indices_batching_dims
        ]
        e.event("contract", "backward", scattered, operand)
    return [out]


def _map_gather_windows(e: Eqn, operand: int, out: int, dn: Any) -> None:
    """Operand slice dims taken whole unify with the output's offset dims."""
    excluded = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    window_dims = [d for d in range(e.rank(operand)) if d not in excluded]
    slice_sizes = e.params["slice_sizes"]
    for operand_dim, out_dim in zip(window_dims, dn.offset_dims):
        if slice_sizes[operand_dim] == e.shape(operand)[operand_dim]:
            e.unify(operand, operand_dim, out, out_dim)
        else:
            e.mark(operand, operand_dim, "windowed dim of gather")
            e.mark(out, out_dim, "windowed dim of gather")
    for dim in set(dn.collapsed_slice_dims) - set(dn.start_index_map):
        e.mark(operand, dim, "collapsed dim of gather")


def _mark_index_vector_dim(e: Eqn, indices: int) -> None:
    if e.rank(indices):
        e.mark(indices, e.rank(indices) - 1, f"index vector dim of {e.name}")


@primitive_rule(
    "scatter",
    "scatter-add",
    "scatter_add",
    "scatter-sub",
    "scatter-mul",
    "scatter-min",
    "scatter-max",
)
def _rule_scatter(e: Eqn) -> list[int]:
    operand, indices, updates = e.ins[0], e.ins[1], e.ins[2]
    out = e.fresh_outputs()[0]
    dn = e.params["dimension_numbers"]
    e.unify_all(operand, out)
    update_scatter = [
        d for d in range(e.rank(updates)) if d not in dn.update_window_dims
    ]
    index_batch = list(range(e.rank(indices) - 1))
    if len(update_scatter) != len(index_batch):
        return e.walker.unknown(e, "scatter with unmapped scatter dims")
    for update_dim, index_dim in zip(update_scatter, index_batch):
        e.unify(updates, update_dim, indices, index_dim)
    for operand_dim, index_dim in zip(
        dn.operand_batching_dims, dn.scatter_indices_batching_dims
    ):
        e.unify(operand, operand_dim, indices, index_dim)
    _map_scatter_windows(e, updates, out, dn)
    _mark_index_vector_dim(e, indices)
    indexed = [
        d for d in dn.scatter_dims_to_operand_dims if d in dn.inserted_window_dims
    ]
    summed = [
        u
        for u, i in zip(update_scatter, index_batch)
        if i not in dn.scatter_indices_batching_dims
    ]
    if e.name in ("scatter-add", "scatter-sub", "scatter_add"):
        e.event("reduce", "forward", [e.element(updates, u) for u in summed], out)
        if e.requires_grad(updates):
            elements = [e.element(out, d) for d in indexed]
            e.event("gather", "backward", elements, updates)
    else:
        for dim in indexed:
            e.mark(out, dim, f"scattered dim of {e.name}")
        for dim in summed:
            e.mark(updates, dim, f"scattered dim of {e.name}")
    return [out]


def _map_scatter_windows(e: Eqn, updates: int, out: int, dn: Any) -> None:
    excluded = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    window_dims = [d for d in range(e.rank(out)) if d not in excluded]
    for out_dim, update_dim in zip(window_dims, dn.update_window_dims):
        if e.shape(updates)[update_dim] == e.shape(out)[out_dim]:
            e.unify(updates, update_dim, out, out_dim)
        else:
            e.mark(updates, update_dim, f"windowed dim of {e.name}")
            e.mark(out, out_dim, f"windowed dim of {e.name}")
