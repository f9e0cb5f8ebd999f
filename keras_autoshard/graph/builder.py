"""Build an `AxisGraph` from a JAX jaxpr of a model's forward pass.

The walker visits every equation of a closed jaxpr (recursing into `jit`,
`checkpoint`, custom-derivative calls, `scan`, `while` and `cond`) and applies
one rule per primitive: it unifies the dimensions that must be sharded alike,
makes fresh axis classes where a primitive creates a new axis, marks classes
that cannot be sharded (with the reason), and records the all-reduces that
sharding a class implies, forward and backward. Primitives it has no rule for
make every dimension they touch unshardable and are counted in
`AxisGraph.unknown_primitives`.

Rules in brief (B = backward event, F = forward event):

- elementwise (add, mul, select_n, convert_element_type, ...): equal dims
  unify; size-1 dims broadcast; a requires-grad operand broadcast along output
  dims gets a B `broadcast_grad` over those dims' classes.
- broadcast_in_dim: mapped dims unify; new/expanded dims are fresh classes
  with a B `broadcast_grad` of the operand.
- dot_general: batch dims unify across lhs/rhs/out, free dims with the output,
  contracting dims with each other; F `contract` on the output over the
  contracting classes; B `contract` on lhs over the rhs free classes and on
  rhs over the lhs free classes.
- reshape: 1-to-1 dims unify; a split or merge links the major factor to the
  result by a `SliceEdge` and makes the minor factors unshardable; any other
  regrouping is unshardable.
- transpose/squeeze/rev map dims; slice/dynamic_slice/pad/concatenate/tile/
  split make the touched operand dim unshardable and link it to the new
  result dim by a `SliceEdge` (tiling a size-1 dim is a broadcast: a fresh
  class); stack/unstack axes and dynamic_update_slice updated dims are
  unshardable.
- reductions: kept dims unify, F `reduce` over the reduced classes;
  argmax/argmin, cumulative ops, sort and top_k make their axis unshardable.
- gather: index batch dims unify with output batch dims, whole slice dims
  with offset dims; F `gather` over the indexed operand dims; B `contract` of
  the operand over the index batch classes. scatter-add: F `reduce` over the
  update scatter classes, B `gather` of the updates; other scatters are
  conservative.
- conv_general_dilated: batch and features as for dot_general, spatial dims
  unshardable, grouped convolutions conservative. reduce_window: windowed
  dims unshardable.
- jit/checkpoint/custom_jvp/custom_vjp/closed_call: walk the body in place.
  scan: carries unify across the loop, the scanned dim is unshardable and body
  events are multiplied by the length. while: carries unify, events counted
  once (noted). cond: every branch is walked and unified with the results.
- fft and batched linear algebra (cholesky, qr, ...): leading dims unify
  across operands and results, the trailing core dims are unshardable.

The rules live in `graph/jaxpr/`, one module per family, each registered
where it is defined (`@primitive_rule`); the walker is `graph/jaxpr/walker.py`.

Backward events on one tensor (and on views of it: reshapes, transposes,
same-size broadcasts, casts) are merged, since the gradient is summed before
it is all-reduced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.extend import core as jcore

import keras_autoshard.graph.jaxpr  # noqa: F401  (registers the primitive rules)
from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.graph.blocks import unit_namer
from keras_autoshard.graph.jaxpr.registry import handled_primitives
from keras_autoshard.graph.jaxpr.walker import Walker, has_grad
from keras_autoshard.graph.walk_state import GraphBuilder

INVAR_KINDS = ("param", "state", "input")


def build_axis_graph(
    closed_jaxpr: jcore.ClosedJaxpr,
    invar_kinds: Sequence[tuple[str, str | None]],
    inputs_made_in_step: bool = False,
) -> AxisGraph:
    """Walk a closed jaxpr and build its axis graph.

    Only shapes and dtypes are read, so a jaxpr traced from
    `jax.ShapeDtypeStruct` leaves (no weights allocated) is enough.

    Args:
        closed_jaxpr: The forward pass, e.g. from `jax.make_jaxpr`.
        invar_kinds: One `(kind, name)` per flattened invar of the jaxpr, where
            kind is `"param"`, `"state"` or `"input"` and name the variable
            path (params, state) or input name.
        inputs_made_in_step: The inputs are batches the train step makes,
            not ones it is fed (`TracedModel.inputs_made_in_step`).

    Returns:
        The `AxisGraph`.

    Example:

    ```python
    closed = jax.make_jaxpr(forward)(param_structs, input_struct)
    kinds = [("param", p) for p in param_paths] + [("input", "x")]
    graph = build_axis_graph(closed, kinds)
    print(graph.summary())
    ```
    """
    jaxpr = closed_jaxpr.jaxpr
    _check_invar_kinds(jaxpr, invar_kinds)
    builder = GraphBuilder(
        unit_namer(str(eqn.source_info.name_stack) for eqn in jaxpr.eqns)
    )
    in_tids = [
        builder.new_tensor(
            var.aval, kind, name, requires_grad=kind == "param" and has_grad(var.aval)
        )
        for var, (kind, name) in zip(jaxpr.invars, invar_kinds)
    ]
    const_tids = [builder.new_tensor(v.aval, "constant") for v in jaxpr.constvars]
    outputs = Walker(builder).walk(jaxpr, const_tids, in_tids, multiplicity=1)
    return dataclasses.replace(
        builder.build(),
        outputs=tuple(outputs),
        several_outputs=builder.calls.several_outputs(outputs),
        inputs_made_in_step=inputs_made_in_step,
    )


def _check_invar_kinds(
    jaxpr: jcore.Jaxpr, invar_kinds: Sequence[tuple[str, str | None]]
) -> None:
    if len(invar_kinds) != len(jaxpr.invars):
        raise ValueError(
            f"invar_kinds has {len(invar_kinds)} entries but the jaxpr has "
            f"{len(jaxpr.invars)} invars; give one (kind, name) per flattened invar."
        )
    bad = sorted({kind for kind, _ in invar_kinds if kind not in INVAR_KINDS})
    if bad:
        raise ValueError(f"Unknown invar kinds {bad}; expected one of {INVAR_KINDS}.")


# Primitives with a rule, for callers that want to report coverage.
HANDLED_PRIMITIVES = handled_primitives()
