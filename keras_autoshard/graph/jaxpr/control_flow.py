"""Calls and loops: jit/pjit/checkpoint/custom-derivative calls walk their
body in place; scan, while and cond.

Each rule registers itself for its primitives with `@primitive_rule`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

from keras_autoshard.graph.jaxpr.registry import primitive_rule
from keras_autoshard.graph.jaxpr.residuals import OWN_RULE_CALLS
from keras_autoshard.graph.jaxpr.walker import (
    NO_GRAD_PRIMITIVES,
    Eqn,
    has_grad,
)

logger = logging.getLogger(__name__)


_SUB_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@primitive_rule(
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "composite",
)
def _rule_call(e: Eqn) -> list[int]:
    """jit/pjit/checkpoint/custom_jvp/custom_vjp/closed_call: walk the body."""
    body = next(
        (e.params[k] for k in _SUB_JAXPR_PARAMS if _is_jaxpr(e.params.get(k))), None
    )
    if body is None or len(_open_jaxpr(body).invars) != len(e.ins):
        return e.walker.unknown(e, f"{e.name} with an unreadable body")
    if e.name not in OWN_RULE_CALLS:
        return e.walker.walk_closed(body, e.ins, e.multiplicity)
    # Its residuals are the call's own (`residuals.call_residuals`).
    e.builder.own_rule_depth += 1
    try:
        return e.walker.walk_closed(body, e.ins, e.multiplicity)
    finally:
        e.builder.own_rule_depth -= 1


def _is_jaxpr(value: Any) -> bool:
    return isinstance(value, jcore.ClosedJaxpr | jcore.Jaxpr)


def _open_jaxpr(value: Any) -> jcore.Jaxpr:
    return value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value


def _output_grad_flags(jaxpr: jcore.Jaxpr, in_flags: Sequence[bool]) -> list[bool]:
    """Which outvars depend on a requires-grad invar (nested calls: any input)."""
    flags: dict[Any, bool] = dict(zip(jaxpr.invars, in_flags))

    def read(atom: Any) -> bool:
        return not isinstance(atom, jcore.Literal) and flags.get(atom, False)

    for eqn in jaxpr.eqns:
        grad_in = any(read(a) for a in eqn.invars)
        grad_in = grad_in and eqn.primitive.name not in NO_GRAD_PRIMITIVES
        for var in eqn.outvars:
            flags[var] = grad_in and has_grad(var.aval)
    return [read(a) for a in jaxpr.outvars]


def _loop_carry_grad_flags(
    body: jcore.Jaxpr,
    before: Sequence[bool],
    init: Sequence[bool],
    after: Sequence[bool],
) -> list[bool]:
    """Fixed point of carry requires-grad flags over loop iterations."""
    carry = list(init)
    while True:
        out = _output_grad_flags(body, [*before, *carry, *after])[: len(carry)]
        new = [a or b for a, b in zip(carry, out)]
        if new == carry:
            return carry
        carry = new


def _loop_carries(
    e: Eqn, carry_vars: Sequence[Any], init: Sequence[int], flags: Sequence[bool]
) -> list[int]:
    """Fresh tensors for loop-body carries, unified with the initial values."""
    carries = []
    for var, init_tid, flag in zip(carry_vars, init, flags):
        tid = e.builder.new_tensor(var.aval, "activation", requires_grad=flag)
        e.unify_all(init_tid, tid)
        carries.append(tid)
    return carries


@primitive_rule("scan")
def _rule_scan(e: Eqn) -> list[int]:
    p = e.params
    body = p["jaxpr"]
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts = e.ins[:n_consts]
    init = e.ins[n_consts : n_consts + n_carry]
    xs = e.ins[n_consts + n_carry :]
    rg = e.requires_grad
    flags = _loop_carry_grad_flags(
        body.jaxpr, [rg(t) for t in consts], [rg(t) for t in init], [rg(t) for t in xs]
    )
    body_invars = body.jaxpr.invars
    carries = _loop_carries(e, body_invars[n_consts : n_consts + n_carry], init, flags)
    x_slices = [
        _scan_slice(e, x, var.aval)
        for x, var in zip(xs, body_invars[len(e.ins) - len(xs) :])
    ]
    outs = e.walker.walk_closed(
        body, [*consts, *carries, *x_slices], e.multiplicity * length
    )
    for carry_out, carry_in in zip(outs[:n_carry], carries):
        e.unify_all(carry_out, carry_in)
    outvars = e.eqn.outvars
    finals = _loop_carries(e, outvars[:n_carry], carries, flags)
    ys = [
        _scan_stack(e, y, var.aval) for y, var in zip(outs[n_carry:], outvars[n_carry:])
    ]
    return [*finals, *ys]


def _scan_slice(e: Eqn, xs: int, slice_aval: Any) -> int:
    """The per-iteration slice of a scanned-over input (keeps a param's name)."""
    name = e.builder.tensors[xs].name
    tid = e.builder.new_tensor(
        slice_aval, "activation", name, requires_grad=e.requires_grad(xs)
    )
    e.mark(xs, 0, "scanned dim of scan")
    for dim in range(e.rank(tid)):
        e.unify(xs, dim + 1, tid, dim)
    return tid


def _scan_stack(e: Eqn, y: int, stacked_aval: Any) -> int:
    """The stacked output of a scan from its per-iteration value."""
    tid = e.builder.new_tensor(
        stacked_aval, "activation", requires_grad=e.requires_grad(y)
    )
    e.mark(tid, 0, "scanned dim of scan")
    for dim in range(e.rank(y)):
        e.unify(y, dim, tid, dim + 1)
    return tid


@primitive_rule("while")
def _rule_while(e: Eqn) -> list[int]:
    p = e.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts = e.ins[:n_cond]
    body_consts = e.ins[n_cond : n_cond + n_body]
    init = e.ins[n_cond + n_body :]
    rg = e.requires_grad
    flags = _loop_carry_grad_flags(
        body.jaxpr, [rg(t) for t in body_consts], [rg(t) for t in init], []
    )
    carries = _loop_carries(e, body.jaxpr.invars[n_body:], init, flags)
    outs = e.walker.walk_closed(body, [*body_consts, *carries], e.multiplicity)
    for carry_out, carry_in in zip(outs, carries):
        e.unify_all(carry_out, carry_in)
    e.walker.walk_closed(cond, [*cond_consts, *carries], e.multiplicity)
    e.builder.notes.append(
        "while (trip count unknown): communication inside a while loop is "
        "counted once per step"
    )
    return _loop_carries(e, e.eqn.outvars, carries, flags)


@primitive_rule("cond")
def _rule_cond(e: Eqn) -> list[int]:
    operands = e.ins[1:]
    branch_outs = [
        e.walker.walk_closed(branch, operands, e.multiplicity)
        for branch in e.params["branches"]
    ]
    results = []
    for index, var in enumerate(e.eqn.outvars):
        flag = any(e.requires_grad(outs[index]) for outs in branch_outs)
        tid = e.builder.new_tensor(var.aval, "activation", requires_grad=flag)
        for outs in branch_outs:
            e.unify_all(outs[index], tid)
        results.append(tid)
    return results
