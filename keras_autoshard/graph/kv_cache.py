"""The keys and values a generation cache holds, found by graph shape.

An attention is two contractions of activations (no parameter on either
side): the *scores* contract two activations made independently of any
such contraction (the queries and the keys), and the *context* contracts
a value made from the scores (softmax, masking, dropout: elementwise work
and relabels) with a third activation, the values. Generating token by
token, a model keeps the keys and values of every earlier token and
recomputes the rest; so a cache holds, per attention, the key and the
value at the full sequence length.

Of the scores' two operands the key is the smaller one as stored: each
operand is followed back through relabels (reshape, transpose), broadcasts
and repeats, and its smallest form is what a cache keeps (grouped-query
attention repeats its key/value heads to the query heads after the cache;
without grouping, queries and keys are the same size and cut alike, so
either gives the same bytes). Layer names are never read.
"""

from __future__ import annotations

import math
from typing import Any


def key_value_pairs(builder: Any) -> tuple[tuple[int, int], ...]:
    """`(key, value)` tensor ids of every attention the walk recorded.

    Args:
        builder: The walk's `GraphBuilder` (its `activation_products`,
            `fused_from`, `view_of`, `broadcast_of` and `repeat_of`).

    Returns:
        One pair per attention, in call order; empty for a model with none.
    """
    products = builder.activation_products
    made_by = {out: index for index, (_, _, out) in enumerate(products)}
    memo: dict[int, int | None] = {}

    def product_behind(tid: int) -> int | None:
        return _product_behind(builder, tid, made_by, memo)

    pairs: list[tuple[int, int]] = []
    for lhs, rhs, _ in products:
        behind = (product_behind(lhs), product_behind(rhs))
        if (behind[0] is None) == (behind[1] is None):
            continue  # scores themselves, or a product of two derived values
        scores_side = 0 if behind[0] is not None else 1
        query_or_key = products[behind[scores_side]][:2]
        if any(product_behind(t) is not None for t in query_or_key):
            continue
        stored = [_stored(builder, t) for t in query_or_key]
        key = min(stored, key=_bytes_then_id(builder))
        pairs.append((key, _stored(builder, (lhs, rhs)[1 - scores_side])))
    return tuple(pairs)


def _bytes_then_id(builder: Any) -> Any:
    """A key function: a tensor's whole bytes, then its id (ties broken
    the same way on every run)."""

    def nbytes(tid: int) -> tuple[int, int]:
        record = builder.tensors[tid]
        return math.prod(record.shape) * record.itemsize, tid

    return nbytes


def _product_behind(
    builder: Any, tid: int, made_by: dict[int, int], memo: dict[int, int | None]
) -> int | None:
    """The activation product `tid` is made from by elementwise work and
    relabels only, or `None`."""
    reached: set[int] = set()
    stack = [tid]
    while stack:  # iterative: a long chain of elementwise work is no recursion
        current = stack.pop()
        if current in reached or current in memo:
            continue
        reached.add(current)
        if current not in made_by:
            stack.extend(_sources(builder, current))
    # A jaxpr makes operands before results: ascending ids settle sources first.
    for current in sorted(reached):
        if current in made_by:
            memo[current] = made_by[current]
            continue
        found = (memo.get(s) for s in _sources(builder, current))
        memo[current] = next((f for f in found if f is not None), None)
    return memo[tid]


def _sources(builder: Any, tid: int) -> tuple[int, ...]:
    sources = list(builder.fused_from.get(tid, ()))
    if tid in builder.view_of:
        sources.append(builder.view_of[tid])
    return tuple(s for s in sources if builder.is_activation(s))


def _stored(builder: Any, tid: int) -> int:
    """The smallest form of `tid` behind relabels, broadcasts and repeats."""
    chain = [tid]
    while True:
        current = chain[-1]
        if current in builder.repeat_of:
            nxt = builder.repeat_of[current]
        elif current in builder.view_of:
            nxt = builder.view_of[current]
        elif current in builder.broadcast_of:
            nxt = builder.broadcast_of[current][0]
        else:
            break
        if nxt in chain or not builder.is_activation(nxt):
            break
        chain.append(nxt)
    nbytes = _bytes_then_id(builder)
    return min(chain, key=lambda t: nbytes(t)[0])  # the first of the smallest
