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
  result dim by a `SliceEdge`; stack/unstack axes and dynamic_update_slice
  updated dims are unshardable.
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

Backward events on one tensor (and on views of it: reshapes, transposes,
same-size broadcasts, casts) are merged, since the gradient is summed before
it is all-reduced.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from keras_autoshard.graph.axis_graph import (
    AxisClass,
    AxisGraph,
    CommEvent,
    DimSizeMismatchError,
    SliceEdge,
    TensorNode,
    UnionFind,
)

logger = logging.getLogger(__name__)

INVAR_KINDS = ("param", "state", "input")

# Primitives whose output carries no gradient even if an input does.
_NO_GRAD_PRIMITIVES = frozenset({"stop_gradient", "floor", "ceil", "round", "sign"})


def build_axis_graph(
    closed_jaxpr: jcore.ClosedJaxpr,
    invar_kinds: Sequence[tuple[str, str | None]],
) -> AxisGraph:
    """Walk a closed jaxpr and build its axis graph.

    Only shapes and dtypes are read, so a jaxpr traced from
    `jax.ShapeDtypeStruct` leaves (no weights allocated) is enough.

    Args:
        closed_jaxpr: The forward pass, e.g. from `jax.make_jaxpr`.
        invar_kinds: One `(kind, name)` per flattened invar of the jaxpr, where
            kind is `"param"`, `"state"` or `"input"` and name the variable
            path (params, state) or input name.

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
    builder = _GraphBuilder()
    in_tids = [
        builder.new_tensor(
            var.aval, kind, name, requires_grad=kind == "param" and _has_grad(var.aval)
        )
        for var, (kind, name) in zip(jaxpr.invars, invar_kinds)
    ]
    const_tids = [builder.new_tensor(v.aval, "constant") for v in jaxpr.constvars]
    _Walker(builder).walk(jaxpr, const_tids, in_tids, multiplicity=1)
    return builder.build()


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


def _aval_shape(aval: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(aval, "shape", ()))


def _aval_itemsize(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return int(getattr(dtype, "itemsize", 0))


def _has_grad(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, np.inexact))
    except TypeError:
        return False


@dataclasses.dataclass
class _TensorRecord:
    shape: tuple[int, ...]
    itemsize: int
    kind: str
    name: str | None
    elements: list[int | None]
    requires_grad: bool


@dataclasses.dataclass
class _EventRecord:
    kind: str
    phase: str
    elements: tuple[int, ...]
    tensor: int
    multiplicity: int
    primitive: str


class _GraphBuilder:
    """Mutable state of one walk: tensors, dim union-find, events, edges."""

    def __init__(self) -> None:
        self.uf = UnionFind()
        self.tensors: list[_TensorRecord] = []
        self.events: list[_EventRecord] = []
        self.slice_edges: list[tuple[int, int, int]] = []
        self.unknown: Counter[str] = Counter()
        self.notes: list[str] = []
        # tensor id -> the tensor it relabels (reshape, transpose, ...).
        self.view_of: dict[int, int] = {}
        # broadcast_in_dim result -> (operand, the result dims it broadcasts).
        self.broadcast_of: dict[int, tuple[int, frozenset[int]]] = {}
        # Name scope (Keras layer path) -> the last tensor of each call.
        self.scope_outputs: dict[str, list[int]] = {}
        self._open_scopes: frozenset[str] = frozenset()

    def record_scope(self, name_stack: str, outs: Sequence[int]) -> None:
        """Note `outs` as the latest output of `name_stack` and its parents.

        Keras enters a JAX name scope per layer call, named by the layer's
        path, so the last top-level equation of a scope's run is the layer's
        output for that call. A scope that was left and is entered again
        (a layer called twice) starts a new call.
        """
        parts = [p for p in name_stack.split("/") if p]
        scopes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for scope in scopes:
            calls = self.scope_outputs.setdefault(scope, [])
            if scope in self._open_scopes and calls:
                calls[-1] = outs[-1]
            else:
                calls.append(outs[-1])
        self._open_scopes = frozenset(scopes)

    def new_tensor(
        self,
        aval: Any,
        kind: str,
        name: str | None = None,
        requires_grad: bool = False,
    ) -> int:
        shape = _aval_shape(aval)
        elements = [self.uf.add(size) if size != 1 else None for size in shape]
        self.tensors.append(
            _TensorRecord(
                shape, _aval_itemsize(aval), kind, name, elements, requires_grad
            )
        )
        return len(self.tensors) - 1

    def shape(self, tid: int) -> tuple[int, ...]:
        return self.tensors[tid].shape

    def element(self, tid: int, dim: int) -> int | None:
        return self.tensors[tid].elements[dim]

    def requires_grad(self, tid: int) -> bool:
        return self.tensors[tid].requires_grad

    def record_view(self, operand: int, out: int) -> None:
        """Note that `out` holds the same bytes as `operand`, relabelled."""
        source, result = self.tensors[operand], self.tensors[out]
        same_count = math.prod(source.shape) == math.prod(result.shape)
        if same_count and source.itemsize == result.itemsize:
            self.view_of[out] = self.view_of.get(operand, operand)

    def unify(self, a: tuple[int, int], b: tuple[int, int], primitive: str) -> None:
        """Put dim `a[1]` of tensor `a[0]` and dim `b[1]` of `b[0]` in one class."""
        elem_a, elem_b = self.element(*a), self.element(*b)
        if elem_a is None or elem_b is None:
            if (elem_a is None) != (elem_b is None):
                self._mismatch(elem_a, elem_b, primitive)
            return
        try:
            self.uf.union(elem_a, elem_b)
        except DimSizeMismatchError as error:
            logger.warning("%s: %s Both dims made unshardable.", primitive, error)
            self._mismatch(elem_a, elem_b, primitive)

    def _mismatch(self, elem_a: int | None, elem_b: int | None, primitive: str) -> None:
        for element in (elem_a, elem_b):
            if element is not None:
                self.uf.mark_unshardable(element, f"dim size mismatch in {primitive}")

    def mark(self, tid: int, dim: int, reason: str) -> None:
        element = self.element(tid, dim)
        if element is not None:
            self.uf.mark_unshardable(element, reason)

    def mark_all(self, tid: int, reason: str) -> None:
        for dim in range(len(self.shape(tid))):
            self.mark(tid, dim, reason)

    def add_event(
        self,
        kind: str,
        phase: str,
        elements: Sequence[int | None],
        tensor: int,
        multiplicity: int,
        primitive: str,
    ) -> None:
        present = tuple(e for e in elements if e is not None)
        if phase == "backward":
            # A view's gradient is its source's gradient, relabelled: sum there.
            tensor = self.view_of.get(tensor, tensor)
        if present:
            self.events.append(
                _EventRecord(kind, phase, present, tensor, multiplicity, primitive)
            )

    def add_slice_edge(
        self,
        source: tuple[int, int],
        target: tuple[int, int],
        reason: str,
        grad_tensor: int | None = None,
    ) -> None:
        """`target` dim may be sharded where `source` dim is not (local slice).

        `grad_tensor` is the tensor whose gradient becomes partial (default:
        the source tensor).
        """
        source_elem, target_elem = self.element(*source), self.element(*target)
        if target_elem is None:
            return
        if source_elem is None:
            self.uf.mark_unshardable(target_elem, reason)
            return
        tensor = source[0] if grad_tensor is None else grad_tensor
        self.slice_edges.append((source_elem, target_elem, tensor, reason))

    def build(self) -> AxisGraph:
        self._mark_repeated_classes()
        class_of, classes = self._compact_classes()
        tensors = tuple(
            TensorNode(
                id=tid,
                shape=record.shape,
                itemsize=record.itemsize,
                kind=record.kind,
                name=record.name,
                dim_classes=tuple(
                    None if e is None else class_of[self.uf.find(e)]
                    for e in record.elements
                ),
                requires_grad=record.requires_grad,
            )
            for tid, record in enumerate(self.tensors)
        )
        return AxisGraph(
            tensors=tensors,
            classes=classes,
            comm_events=self._final_events(class_of),
            slice_edges=self._final_slice_edges(class_of),
            unknown_primitives=tuple(sorted(self.unknown.items())),
            notes=tuple(dict.fromkeys(self.notes)),
            scope_outputs=tuple(
                (scope, tuple(calls)) for scope, calls in self.scope_outputs.items()
            ),
        )

    def _mark_repeated_classes(self) -> None:
        for tid, record in enumerate(self.tensors):
            seen: set[int] = set()
            for element in record.elements:
                if element is None:
                    continue
                root = self.uf.find(element)
                if root in seen:
                    self.uf.mark_unshardable(root, f"appears twice in tensor {tid}")
                seen.add(root)

    def _compact_classes(self) -> tuple[dict[int, int], tuple[AxisClass, ...]]:
        members: dict[int, list[tuple[int, int]]] = {}
        for tid, record in enumerate(self.tensors):
            for dim, element in enumerate(record.elements):
                if element is not None:
                    members.setdefault(self.uf.find(element), []).append((tid, dim))
        class_of = {root: index for index, root in enumerate(members)}
        classes = tuple(
            AxisClass(
                id=class_of[root],
                size=self.uf.dim_size(root),
                unshardable_reason=self.uf.reason(root),
                dims=tuple(dims),
            )
            for root, dims in members.items()
        )
        return class_of, classes

    def _event_classes(
        self, elements: Sequence[int], class_of: dict[int, int]
    ) -> tuple[int, ...]:
        return tuple(dict.fromkeys(class_of[self.uf.find(e)] for e in elements))

    def _final_events(self, class_of: dict[int, int]) -> tuple[CommEvent, ...]:
        forward = [
            CommEvent(
                kind=r.kind,
                phase=r.phase,
                classes=self._event_classes(r.elements, class_of),
                tensor=r.tensor,
                multiplicity=r.multiplicity,
                primitive=r.primitive,
            )
            for r in self.events
            if r.phase == "forward"
        ]
        return tuple(forward) + self._merged_backward_events(class_of)

    def _merged_backward_events(
        self, class_of: dict[int, int]
    ) -> tuple[CommEvent, ...]:
        """One backward event per (tensor, multiplicity): gradients sum first."""
        groups: dict[tuple[int, int], list[_EventRecord]] = {}
        for record in self.events:
            if record.phase == "backward":
                key = (record.tensor, record.multiplicity)
                groups.setdefault(key, []).append(record)
        merged = []
        for (tensor, multiplicity), records in groups.items():
            elements = [e for r in records for e in r.elements]
            primitives = dict.fromkeys(r.primitive for r in records)
            merged.append(
                CommEvent(
                    kind=records[0].kind,
                    phase="backward",
                    classes=self._event_classes(elements, class_of),
                    tensor=tensor,
                    multiplicity=multiplicity,
                    primitive="+".join(primitives),
                )
            )
        return tuple(merged)

    def _final_slice_edges(self, class_of: dict[int, int]) -> tuple[SliceEdge, ...]:
        edges: dict[tuple[int, int, int], str] = {}
        for source, target, tensor, reason in self.slice_edges:
            source_class = class_of[self.uf.find(source)]
            target_class = class_of[self.uf.find(target)]
            if source_class != target_class:
                edges.setdefault((source_class, target_class, tensor), reason)
        return tuple(
            SliceEdge(s, t, tensor, reason) for (s, t, tensor), reason in edges.items()
        )


@dataclasses.dataclass
class _Eqn:
    """One equation being walked, with its input tensor ids."""

    eqn: jcore.JaxprEqn
    ins: list[int]
    multiplicity: int
    builder: _GraphBuilder
    walker: _Walker

    @property
    def name(self) -> str:
        return self.eqn.primitive.name

    @property
    def params(self) -> dict[str, Any]:
        return self.eqn.params

    def shape(self, tid: int) -> tuple[int, ...]:
        return self.builder.shape(tid)

    def rank(self, tid: int) -> int:
        return len(self.builder.shape(tid))

    def element(self, tid: int, dim: int) -> int | None:
        return self.builder.element(tid, dim)

    def requires_grad(self, tid: int) -> bool:
        return self.builder.requires_grad(tid)

    def fresh_outputs(self) -> list[int]:
        """New activation tensors for the outputs, each dim a fresh class."""
        grad_in = any(self.builder.requires_grad(t) for t in self.ins)
        grad_out = grad_in and self.name not in _NO_GRAD_PRIMITIVES
        return [
            self.builder.new_tensor(
                var.aval, "activation", requires_grad=grad_out and _has_grad(var.aval)
            )
            for var in self.eqn.outvars
        ]

    def unify(self, a: int, a_dim: int, b: int, b_dim: int) -> None:
        self.builder.unify((a, a_dim), (b, b_dim), self.name)

    def unify_all(self, a: int, b: int) -> None:
        """Unify every dim of `a` with the same dim of `b` (equal shapes)."""
        if self.shape(a) != self.shape(b):
            self.mark_all(a, f"shape mismatch in {self.name}")
            self.mark_all(b, f"shape mismatch in {self.name}")
            return
        for dim in range(self.rank(a)):
            self.unify(a, dim, b, dim)

    def mark(self, tid: int, dim: int, reason: str) -> None:
        self.builder.mark(tid, dim, reason)

    def mark_all(self, tid: int, reason: str) -> None:
        self.builder.mark_all(tid, reason)

    def event(
        self, kind: str, phase: str, elements: Sequence[int | None], tensor: int
    ) -> None:
        self.builder.add_event(
            kind, phase, elements, tensor, self.multiplicity, self.name
        )

    def slice_edge(self, operand: int, dim: int, out: int, out_dim: int) -> None:
        """Operand `dim` is positionally selected into `out_dim` (slice/pad/...)."""
        reason = f"{_positional_word(self.name)} dim of {self.name}"
        self.mark(operand, dim, reason)
        self.builder.add_slice_edge((operand, dim), (out, out_dim), reason)


def _positional_word(primitive: str) -> str:
    words = {"pad": "padded", "concatenate": "concatenated", "tile": "tiled"}
    return words.get(primitive, "sliced")


_Rule = Callable[[_Eqn], list[int]]

# Elementwise primitives whose result is a relabelled copy of their operand.
_VIEW_PRIMITIVES = frozenset({"convert_element_type", "copy", "copy_p"})


class _Walker:
    """Walks jaxprs, dispatching each equation to its primitive's rule."""

    def __init__(self, builder: _GraphBuilder) -> None:
        self.builder = builder
        self._warned: set[str] = set()
        self._depth = 0

    def walk(
        self,
        jaxpr: jcore.Jaxpr,
        const_tids: Sequence[int],
        in_tids: Sequence[int],
        multiplicity: int,
    ) -> list[int]:
        """Walk `jaxpr` with its vars bound to tensor ids; return the outvar ids."""
        env: dict[Any, int] = {}
        env.update(zip(jaxpr.constvars, const_tids))
        env.update(zip(jaxpr.invars, in_tids))
        self._depth += 1
        try:
            for eqn in jaxpr.eqns:
                ins = [self._read(env, atom) for atom in eqn.invars]
                outs = self._apply(_Eqn(eqn, ins, multiplicity, self.builder, self))
                env.update(zip(eqn.outvars, outs))
                if self._depth == 1 and outs:
                    self.builder.record_scope(str(eqn.source_info.name_stack), outs)
        finally:
            self._depth -= 1
        return [self._read(env, atom) for atom in jaxpr.outvars]

    def walk_closed(
        self, closed: Any, in_tids: Sequence[int], multiplicity: int
    ) -> list[int]:
        """Walk a `ClosedJaxpr` or open `Jaxpr`; its consts become constants."""
        jaxpr = closed.jaxpr if isinstance(closed, jcore.ClosedJaxpr) else closed
        const_tids = [
            self.builder.new_tensor(v.aval, "constant") for v in jaxpr.constvars
        ]
        return self.walk(jaxpr, const_tids, in_tids, multiplicity)

    def _read(self, env: dict[Any, int], atom: Any) -> int:
        if isinstance(atom, jcore.Literal):
            return self.builder.new_tensor(atom.aval, "constant")
        return env[atom]

    def _apply(self, eqn: _Eqn) -> list[int]:
        rule = _RULES.get(eqn.name)
        if rule is None:
            return self.unknown(eqn)
        return rule(eqn)

    def unknown(self, eqn: _Eqn, why: str | None = None) -> list[int]:
        """Conservative fallback: every dim touched becomes unshardable."""
        reason = why or f"unknown primitive '{eqn.name}'"
        if why is None:
            self.builder.unknown[eqn.name] += 1
            if eqn.name not in self._warned:
                self._warned.add(eqn.name)
                logger.warning(
                    "No axis rule for primitive %r: its dims are made unshardable.",
                    eqn.name,
                )
        for tid in eqn.ins:
            eqn.mark_all(tid, reason)
        outs = eqn.fresh_outputs()
        for tid in outs:
            eqn.mark_all(tid, reason)
        return outs


# --------------------------------------------------------------------------
# Elementwise, identity and random rules.


def _rule_elementwise(e: _Eqn) -> list[int]:
    outs = e.fresh_outputs()
    for out in outs:
        for operand in e.ins:
            _map_broadcasting_operand(e, operand, out)
    if e.name in _VIEW_PRIMITIVES:
        e.builder.record_view(e.ins[0], outs[0])
    return outs


def _map_broadcasting_operand(e: _Eqn, operand: int, out: int) -> None:
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


def _rule_per_operand_identity(e: _Eqn) -> list[int]:
    outs = e.fresh_outputs()
    if len(outs) != len(e.ins):
        return e.walker.unknown(e, f"operand/result count mismatch in {e.name}")
    for operand, out in zip(e.ins, outs):
        e.unify_all(operand, out)
        e.builder.record_view(operand, out)
    return outs


def _rule_fresh(e: _Eqn) -> list[int]:
    return e.fresh_outputs()


def _rule_random(e: _Eqn) -> list[int]:
    """Elementwise where every non-scalar operand matches the output shape."""
    outs = e.fresh_outputs()
    for out in outs:
        operands = [t for t in e.ins if e.shape(t)]
        if all(e.shape(t) == e.shape(out) for t in operands):
            for operand in operands:
                e.unify_all(operand, out)
    return outs


def _rule_bitcast_convert_type(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    if e.shape(operand) == e.shape(out):
        e.unify_all(operand, out)
    else:
        e.mark_all(operand, "bitcast_convert_type changing the shape")
        e.mark_all(out, "bitcast_convert_type changing the shape")
    return [out]


# --------------------------------------------------------------------------
# Layout rules: broadcast, reshape, transpose, squeeze, rev.


def _rule_broadcast_in_dim(e: _Eqn) -> list[int]:
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


def _rule_reshape(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    groups = _reshape_groups(e.shape(operand), e.shape(out))
    if e.params.get("dimensions") is not None or groups is None:
        reason = "reshape with no contiguous factorisation"
        e.mark_all(operand, reason)
        e.mark_all(out, reason)
        return [out]
    for group_in, group_out in groups:
        _map_reshape_group(e, operand, out, group_in, group_out)
    e.builder.record_view(operand, out)
    return [out]


def _map_reshape_group(
    e: _Eqn, operand: int, out: int, group_in: list[int], group_out: list[int]
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
        e.builder.add_slice_edge(
            (operand, group_in[0]),
            (out, group_out[0]),
            "reshape merge" if repeat_source is None else "repeat",
            repeat_source,
        )
        for dim in group_in[1:]:
            e.mark(operand, dim, "minor factor of reshape merge")
    else:
        in_sizes = tuple(e.shape(operand)[d] for d in group_in)
        out_sizes = tuple(e.shape(out)[d] for d in group_out)
        reason = f"reshape {in_sizes}->{out_sizes} is neither a split nor a merge"
        for dim in group_in:
            e.mark(operand, dim, reason)
        for dim in group_out:
            e.mark(out, dim, reason)


def _repeat_source(e: _Eqn, operand: int, group_in: list[int]) -> int | None:
    """The un-repeated tensor when a merge undoes a broadcast (`jnp.repeat`).

    Sharding the merged dim then makes the gradient partial only after the
    broadcast's sum, so the backward all-reduce is on the smaller source.
    """
    source, broadcast_dims = e.builder.broadcast_of.get(operand, (None, frozenset()))
    repeated = set(group_in[1:]) <= broadcast_dims
    if source is None or not repeated or group_in[0] in broadcast_dims:
        return None
    return source


def _rule_transpose(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    for out_dim, in_dim in enumerate(e.params["permutation"]):
        e.unify(operand, in_dim, out, out_dim)
    e.builder.record_view(operand, out)
    return [out]


def _rule_squeeze(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    rank = e.rank(operand)
    removed = {d % rank for d in e.params["dimensions"]}
    kept = [d for d in range(rank) if d not in removed]
    for out_dim, in_dim in enumerate(kept):
        e.unify(operand, in_dim, out, out_dim)
    e.builder.record_view(operand, out)
    return [out]


def _rule_same_shape(e: _Eqn) -> list[int]:
    """rev and friends: output dims are the operand dims, reordered in place."""
    operand, out = e.ins[0], e.fresh_outputs()[0]
    e.unify_all(operand, out)
    return [out]


# --------------------------------------------------------------------------
# Slicing, padding, concatenation, splitting, stacking.


def _rule_slice(e: _Eqn) -> list[int]:
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


def _rule_dynamic_slice(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    for dim, (size, out_size) in enumerate(zip(e.shape(operand), e.shape(out))):
        if size == out_size:
            e.unify(operand, dim, out, dim)
        else:
            e.slice_edge(operand, dim, out, dim)
    return [out]


def _rule_dynamic_update_slice(e: _Eqn) -> list[int]:
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


def _rule_pad(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    for dim, config in enumerate(e.params["padding_config"]):
        if tuple(int(c) for c in config) == (0, 0, 0):
            e.unify(operand, dim, out, dim)
        else:
            e.slice_edge(operand, dim, out, dim)
    return [out]


def _rule_concatenate(e: _Eqn) -> list[int]:
    out = e.fresh_outputs()[0]
    axis = e.params["dimension"]
    for operand in e.ins:
        for dim in range(e.rank(out)):
            if dim == axis:
                e.slice_edge(operand, dim, out, dim)
            else:
                e.unify(operand, dim, out, dim)
    return [out]


def _rule_tile(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    for dim, reps in enumerate(e.params["reps"]):
        if reps == 1:
            e.unify(operand, dim, out, dim)
        else:
            e.slice_edge(operand, dim, out, dim)
    return [out]


def _rule_split(e: _Eqn) -> list[int]:
    operand, outs = e.ins[0], e.fresh_outputs()
    axis = e.params["axis"] % e.rank(operand)
    for out in outs:
        for dim in range(e.rank(operand)):
            if dim == axis:
                e.slice_edge(operand, dim, out, dim)
            else:
                e.unify(operand, dim, out, dim)
    return outs


def _rule_stack(e: _Eqn) -> list[int]:
    out = e.fresh_outputs()[0]
    axis = e.params["axis"] % e.rank(out)
    kept = [d for d in range(e.rank(out)) if d != axis]
    for operand in e.ins:
        for in_dim, out_dim in enumerate(kept):
            e.unify(operand, in_dim, out, out_dim)
    e.mark(out, axis, "stacked dim of stack")
    return [out]


def _rule_unstack(e: _Eqn) -> list[int]:
    operand, outs = e.ins[0], e.fresh_outputs()
    axis = e.params["axis"] % e.rank(operand)
    kept = [d for d in range(e.rank(operand)) if d != axis]
    e.mark(operand, axis, "unstacked dim of unstack")
    for out in outs:
        for out_dim, in_dim in enumerate(kept):
            e.unify(operand, in_dim, out, out_dim)
    return outs


# --------------------------------------------------------------------------
# Contractions and reductions.


def _rule_dot_general(e: _Eqn) -> list[int]:
    lhs, rhs, out = e.ins[0], e.ins[1], e.fresh_outputs()[0]
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = e.params["dimension_numbers"]
    lhs_free = _free_dims(e.rank(lhs), lhs_contract, lhs_batch)
    rhs_free = _free_dims(e.rank(rhs), rhs_contract, rhs_batch)
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
    if e.requires_grad(lhs):
        e.event("contract", "backward", [e.element(out, o) for o in rhs_free_out], lhs)
    if e.requires_grad(rhs):
        e.event("contract", "backward", [e.element(out, o) for o in lhs_free_out], rhs)
    return [out]


def _free_dims(rank: int, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
    used = set(contract) | set(batch)
    return [d for d in range(rank) if d not in used]


def _map_reduction(
    e: _Eqn, operand: int, out: int, axes: Sequence[int]
) -> list[int | None]:
    """Unify kept dims with the output; return the reduced dims' elements."""
    rank = e.rank(operand)
    reduced = {a % rank for a in axes}
    kept = [d for d in range(rank) if d not in reduced]
    for out_dim, in_dim in enumerate(kept):
        e.unify(operand, in_dim, out, out_dim)
    return [e.element(operand, d) for d in sorted(reduced)]


def _rule_reduce(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    reduced = _map_reduction(e, operand, out, e.params["axes"])
    e.event("reduce", "forward", reduced, out)
    return [out]


def _rule_variadic_reduce(e: _Eqn) -> list[int]:
    outs = e.fresh_outputs()
    for operand, out in zip(e.ins[: len(outs)], outs):
        reduced = _map_reduction(e, operand, out, e.params["dimensions"])
        e.event("reduce", "forward", reduced, out)
    return outs


def _rule_argminmax(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    axes = e.params["axes"]
    _map_reduction(e, operand, out, axes)
    for axis in axes:
        e.mark(operand, axis % e.rank(operand), f"reduced dim of {e.name}")
    return [out]


def _rule_cumulative(e: _Eqn) -> list[int]:
    operand, out = e.ins[0], e.fresh_outputs()[0]
    e.unify_all(operand, out)
    e.mark(operand, e.params["axis"] % e.rank(operand), f"scanned dim of {e.name}")
    return [out]


def _rule_sort(e: _Eqn) -> list[int]:
    outs = e.fresh_outputs()
    first = e.ins[0]
    for tid in [*e.ins[1:], *outs]:
        e.unify_all(first, tid)
    e.mark(first, e.params["dimension"] % e.rank(first), "sorted dim of sort")
    return outs


def _rule_top_k(e: _Eqn) -> list[int]:
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


def _rule_reduce_window(e: _Eqn) -> list[int]:
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


def _rule_conv(e: _Eqn) -> list[int]:
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
    grouped = e.params.get("feature_group_count", 1) != 1
    if grouped or e.params.get("batch_group_count", 1) != 1:
        reason = f"grouped {e.name}"
        for tid, dim in ((lhs, lhs_feature), (rhs, rhs_in), (rhs, rhs_out)):
            e.mark(tid, dim, reason)
        e.mark(out, out_feature, reason)
    else:
        e.unify(lhs, lhs_feature, rhs, rhs_in)
        e.unify(rhs, rhs_out, out, out_feature)
    e.event("contract", "forward", [e.element(lhs, lhs_feature)], out)
    if e.requires_grad(lhs):
        e.event("contract", "backward", [e.element(rhs, rhs_out)], lhs)
    if e.requires_grad(rhs):
        e.event("contract", "backward", [e.element(lhs, lhs_batch)], rhs)
    return [out]


# --------------------------------------------------------------------------
# Gather and scatter.


def _rule_gather(e: _Eqn) -> list[int]:
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


def _map_gather_windows(e: _Eqn, operand: int, out: int, dn: Any) -> None:
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


def _mark_index_vector_dim(e: _Eqn, indices: int) -> None:
    if e.rank(indices):
        e.mark(indices, e.rank(indices) - 1, f"index vector dim of {e.name}")


def _rule_scatter(e: _Eqn) -> list[int]:
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


def _map_scatter_windows(e: _Eqn, updates: int, out: int, dn: Any) -> None:
    excluded = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    window_dims = [d for d in range(e.rank(out)) if d not in excluded]
    for out_dim, update_dim in zip(window_dims, dn.update_window_dims):
        if e.shape(updates)[update_dim] == e.shape(out)[out_dim]:
            e.unify(updates, update_dim, out, out_dim)
        else:
            e.mark(updates, update_dim, f"windowed dim of {e.name}")
            e.mark(out, out_dim, f"windowed dim of {e.name}")


# --------------------------------------------------------------------------
# Sub-jaxprs: calls, scan, while, cond.

_SUB_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _rule_call(e: _Eqn) -> list[int]:
    """jit/pjit/checkpoint/custom_jvp/custom_vjp/closed_call: walk the body."""
    body = next(
        (e.params[k] for k in _SUB_JAXPR_PARAMS if _is_jaxpr(e.params.get(k))), None
    )
    if body is None or len(_open_jaxpr(body).invars) != len(e.ins):
        return e.walker.unknown(e, f"{e.name} with an unreadable body")
    return e.walker.walk_closed(body, e.ins, e.multiplicity)


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
        grad_in = grad_in and eqn.primitive.name not in _NO_GRAD_PRIMITIVES
        for var in eqn.outvars:
            flags[var] = grad_in and _has_grad(var.aval)
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
    e: _Eqn, carry_vars: Sequence[Any], init: Sequence[int], flags: Sequence[bool]
) -> list[int]:
    """Fresh tensors for loop-body carries, unified with the initial values."""
    carries = []
    for var, init_tid, flag in zip(carry_vars, init, flags):
        tid = e.builder.new_tensor(var.aval, "activation", requires_grad=flag)
        e.unify_all(init_tid, tid)
        carries.append(tid)
    return carries


def _rule_scan(e: _Eqn) -> list[int]:
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


def _scan_slice(e: _Eqn, xs: int, slice_aval: Any) -> int:
    """The per-iteration slice of a scanned-over input (keeps a param's name)."""
    name = e.builder.tensors[xs].name
    tid = e.builder.new_tensor(
        slice_aval, "activation", name, requires_grad=e.requires_grad(xs)
    )
    e.mark(xs, 0, "scanned dim of scan")
    for dim in range(e.rank(tid)):
        e.unify(xs, dim + 1, tid, dim)
    return tid


def _scan_stack(e: _Eqn, y: int, stacked_aval: Any) -> int:
    """The stacked output of a scan from its per-iteration value."""
    tid = e.builder.new_tensor(
        stacked_aval, "activation", requires_grad=e.requires_grad(y)
    )
    e.mark(tid, 0, "scanned dim of scan")
    for dim in range(e.rank(y)):
        e.unify(y, dim, tid, dim + 1)
    return tid


def _rule_while(e: _Eqn) -> list[int]:
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


def _rule_cond(e: _Eqn) -> list[int]:
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


# --------------------------------------------------------------------------
# The rule table.

_ELEMENTWISE = (
    "abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp "
    "complex conj convert_element_type copy copy_p cos cosh digamma div eq erf "
    "erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag integer_pow "
    "is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or "
    "polygamma population_count pow real reduce_precision rem round rsqrt "
    "select_n sign sin sinh sqrt square stop_gradient sub tan tanh xor clz "
    "bessel_i0e bessel_i1e zeta"
).split()

_RANDOM = (
    "random_seed random_bits random_split random_fold_in random_wrap "
    "random_unwrap random_clone threefry2x32 shift_left shift_right_logical "
    "shift_right_arithmetic mulhi rng_bit_generator rng_uniform"
).split()

_RULES: dict[str, _Rule] = {
    **dict.fromkeys(_ELEMENTWISE, _rule_elementwise),
    **dict.fromkeys(_RANDOM, _rule_random),
    **dict.fromkeys(
        ("optimization_barrier", "device_put", "sharding_constraint", "mesh_cast"),
        _rule_per_operand_identity,
    ),
    **dict.fromkeys(("iota", "empty", "empty2", "create_token"), _rule_fresh),
    **dict.fromkeys(
        ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod"), _rule_reduce
    ),
    **dict.fromkeys(("reduce_and", "reduce_or", "reduce_xor"), _rule_reduce),
    **dict.fromkeys(("argmax", "argmin"), _rule_argminmax),
    **dict.fromkeys(
        ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"), _rule_cumulative
    ),
    **dict.fromkeys(
        ("reduce_window_sum", "reduce_window_max", "reduce_window_min"),
        _rule_reduce_window,
    ),
    **dict.fromkeys(
        ("scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter-mul"),
        _rule_scatter,
    ),
    **dict.fromkeys(("scatter-min", "scatter-max"), _rule_scatter),
    **dict.fromkeys(
        (
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
        ),
        _rule_call,
    ),
    "reduce_window": _rule_reduce_window,
    "reduce": _rule_variadic_reduce,
    "bitcast_convert_type": _rule_bitcast_convert_type,
    "broadcast_in_dim": _rule_broadcast_in_dim,
    "reshape": _rule_reshape,
    "transpose": _rule_transpose,
    "squeeze": _rule_squeeze,
    "rev": _rule_same_shape,
    "slice": _rule_slice,
    "dynamic_slice": _rule_dynamic_slice,
    "dynamic_update_slice": _rule_dynamic_update_slice,
    "pad": _rule_pad,
    "concatenate": _rule_concatenate,
    "tile": _rule_tile,
    "split": _rule_split,
    "stack": _rule_stack,
    "unstack": _rule_unstack,
    "dot_general": _rule_dot_general,
    "conv_general_dilated": _rule_conv,
    "sort": _rule_sort,
    "top_k": _rule_top_k,
    "gather": _rule_gather,
    "scan": _rule_scan,
    "while": _rule_while,
    "cond": _rule_cond,
}

# Primitives with a rule, for callers that want to report coverage.
HANDLED_PRIMITIVES = frozenset(_RULES)
