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
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core as jcore

import keras_autoshard.graph.jaxpr  # noqa: F401  (registers the primitive rules)
from keras_autoshard.graph.axis_graph import (
    AxisClass,
    AxisGraph,
    CommEvent,
    DimSizeMismatchError,
    GroupedConv,
    SliceEdge,
    TensorNode,
)
from keras_autoshard.graph.blocks import ScopeTracker, unit_namer
from keras_autoshard.graph.events import EventRecord, final_events
from keras_autoshard.graph.fusion import (
    cast_pairs,
    kept_after_fusion,
    note_fusion,
    product_images,
)
from keras_autoshard.graph.jaxpr.registry import (
    ELEMENTWISE_PRIMITIVES,
    handled_primitives,
)
from keras_autoshard.graph.jaxpr.residuals import (
    STRUCTURAL_PRIMITIVES,
    ResidualsUnknown,
    residuals_of,
)
from keras_autoshard.graph.jaxpr.walker import (
    Walker,
    aval_itemsize,
    aval_shape,
    has_grad,
)
from keras_autoshard.graph.kv_cache import key_value_pairs
from keras_autoshard.graph.layer_calls import CallReturns
from keras_autoshard.graph.union_find import UnionFind

logger = logging.getLogger(__name__)

INVAR_KINDS = ("param", "state", "input")
# Equations whose backward pass needs several buffers the size of their
# operand at once: a max or min pooling's gradient is lowered by XLA to
# reduce-windows over (value, index) pairs with index tensors of the input's
# size (six such buffers measured on XLA:CPU, jax 0.10).
WORKSPACE_FACTORS = {"reduce_window_max": 6.0, "reduce_window_min": 6.0}
# Equations XLA fuses into their consumers (elementwise work and relabels).
FUSIBLE_PRIMITIVES = frozenset(ELEMENTWISE_PRIMITIVES) | {
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
}


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
    builder = _GraphBuilder(
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


@dataclasses.dataclass
class _TensorRecord:
    shape: tuple[int, ...]
    itemsize: int
    kind: str
    name: str | None
    elements: list[int | None]
    requires_grad: bool


class _GraphBuilder:
    """Mutable state of one walk: tensors, dim union-find, events, edges."""

    def __init__(self, unit_of: Callable[[str], str] | None = None) -> None:
        self.uf = UnionFind()
        self.tensors: list[_TensorRecord] = []
        self.events: list[EventRecord] = []
        self.slice_edges: list[tuple[int, int, int]] = []
        self.unknown: Counter[str] = Counter()
        self.notes: list[str] = []
        self.grouped_convs: list[GroupedConv] = []
        # tensor id -> the tensor it relabels (reshape, transpose, ...).
        self.view_of: dict[int, int] = {}
        self.cast_of: dict[int, int] = {}  # a precision cast -> its source
        # broadcast_in_dim result -> (operand, the result dims it broadcasts).
        self.broadcast_of: dict[int, tuple[int, frozenset[int]]] = {}
        # Name scope (Keras layer path) -> the last tensor of each call.
        self.scope_outputs: dict[str, list[int]] = {}
        self._open_scopes: frozenset[str] = frozenset()
        self.calls = CallReturns()
        self.layers = ScopeTracker(unit_of)
        # (tensor id, bytes per tensor byte) -> times kept (loop trips).
        self.residuals: dict[tuple[int, float], int] = {}
        # The same key -> the top-level layers whose equations keep it.
        self.residual_layers: dict[tuple[int, float], set[str]] = {}
        # Derivative intermediates of elementwise equations that keep
        # nothing else: (tensor tied to, operands, times, layer), resolved
        # once every equation's residuals are known (`_resolve_derived`).
        self._derived: list[tuple[int, tuple[int, ...], int, str]] = []
        self.other_residual_bytes = 0
        # Tensors computed from constants only.
        self.constant_like: set[int] = set()
        # Output of an elementwise (fusible) equation -> its operands.
        self.fused_from: dict[int, tuple[int, ...]] = {}
        # Output of a fusible equation -> its primitive's name.
        self.made_by: dict[int, str] = {}
        # Operand -> primitives of the unfusible equations that read it, and
        # a reduction's output -> its operand (`graph/fusion.py`).
        self.unfused_readers: dict[int, set[str]] = {}
        # The same for the source of a relabelled view an unfusible
        # equation reads (a matmul reading a copy or reshape of it).
        self.readers_through_views: dict[int, set[str]] = {}
        self.reduced_from: dict[int, int] = {}
        # Operand -> buffers of its size its equation's backward needs at once.
        self.workspaces: dict[int, float] = {}
        # A max or min pooling's operand -> (its output, its layer).
        self.poolings: dict[int, tuple[int, str]] = {}
        # > 0 while walking the body of a call whose own derivative rule
        # decides its residuals (a custom JVP call): its equations keep none.
        self.own_rule_depth = 0
        # Tensor -> the top-level layers whose equations read it.
        self.readers: dict[int, set[str]] = {}
        # (lhs, rhs, out) of each contraction of two activations, in order;
        # and a repeat's result -> the tensor it repeats (`graph/kv_cache.py`).
        self.activation_products: list[tuple[int, int, int]] = []
        self.repeat_of: dict[int, int] = {}
        # Operands of every matrix product and convolution (`matmul_operands`),
        # and those XLA lays out anew for their product (`relaid_operands`).
        self.matmul_operands: set[int] = set()
        self.matmul_pairs: dict[tuple[int, int], None] = {}
        # Output -> (lhs, rhs, lhs free dims) of each product with no batch
        # dims (`AxisGraph.products`).
        self.unbatched_products: dict[int, tuple[int, int, int]] = {}
        self.relaid_operands: set[int] = set()

    def record_residuals(self, eqn, outs: Sequence[int]) -> None:
        """Note what `eqn` keeps for the backward pass (`residuals.py`);
        a value kept by several equations, or through a view of it, once."""
        self.layers.record(eqn.ins, outs, self.is_activation)
        for tid in eqn.ins:
            self.readers.setdefault(tid, set()).add(self.layers.current)
        name = eqn.eqn.primitive.name
        if name in WORKSPACE_FACTORS and eqn.ins:
            self.workspaces[eqn.ins[0]] = WORKSPACE_FACTORS[name]
            self.poolings[eqn.ins[0]] = (outs[0], self.layers.current)
        if name not in STRUCTURAL_PRIMITIVES:
            note_fusion(self, name, name in FUSIBLE_PRIMITIVES, eqn.ins, outs)
        if all(t in self.constant_like for t in eqn.ins):
            # Computed from constants alone (rotary tables from iota): XLA
            # folds it into the program's constants, nothing is kept.
            self.constant_like.update(outs)
            return
        if self.own_rule_depth:
            return
        grads = [self.requires_grad(t) for t in eqn.ins]
        try:
            found = residuals_of(eqn.eqn, eqn.params, grads)
        except ResidualsUnknown as unknown:  # the fallback, said in a note
            found = unknown.assumed
            self.notes.append(unknown.note(eqn.layer))
        for residual in found:
            if residual.side == "other":
                self.other_residual_bytes += residual.nbytes * eqn.multiplicity
                continue
            tid = (eqn.ins if residual.side == "in" else outs)[residual.index]
            if residual.derived and name in FUSIBLE_PRIMITIVES:
                if all(other.derived for other in found):
                    self._derived.append(
                        (tid, tuple(eqn.ins), eqn.multiplicity, self.layers.current)
                    )
                continue
            if tid in self.constant_like:
                continue
            whole = math.prod(self.shape(tid)) * self.tensors[tid].itemsize
            scale = residual.nbytes / whole if whole else 0.0
            key = (self.view_of.get(tid, tid), scale)
            self.residuals[key] = max(self.residuals.get(key, 0), eqn.multiplicity)
            self.residual_layers.setdefault(key, set()).add(self.layers.current)

    def _resolve_derived(self) -> None:
        """Keep what elementwise equations' derivative intermediates are
        recomputed from (`2 x` of `x ** 2`, `s (1 - s)` of a sigmoid).

        XLA computes such an intermediate inside the backward fusion that
        reads it. An equation that also keeps its output or an operand
        recomputes it from those (`record_residuals` drops it). Otherwise
        it comes from the equation's output where something else keeps that
        output (a ReLU's output a matrix product reads), and else from the
        operand of its shape that carries a gradient: a square read only by
        a reduction is fused into the reduction, never materialised, and
        its derivative `2 x` is made from `x`.
        """
        for tied, operands, times, layer in self._derived:
            source = tied
            if (self.view_of.get(tied, tied), 1.0) not in self.residuals:
                shape = self.shape(tied)
                source = next(
                    (
                        tid
                        for tid in operands
                        if self.shape(tid) == shape and self.requires_grad(tid)
                    ),
                    tied,
                )
            if source in self.constant_like:
                continue
            key = (self.view_of.get(source, source), 1.0)
            self.residuals[key] = max(self.residuals.get(key, 0), times)
            self.residual_layers.setdefault(key, set()).add(layer)

    def is_activation(self, tid: int) -> bool:
        return self.tensors[tid].kind == "activation" and tid not in self.constant_like

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
        shape = aval_shape(aval)
        if kind == "constant":
            self.constant_like.add(len(self.tensors))
        elements = [self.uf.add(size) if size != 1 else None for size in shape]
        self.tensors.append(
            _TensorRecord(
                shape, aval_itemsize(aval), kind, name, elements, requires_grad
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

    def note_matmul_operands(self, *tids: int) -> None:
        """Note the operands of a matrix product or convolution, and the
        tensors they are views of (residuals are recorded by the source)."""
        for tid in tids:
            self.matmul_operands.update((tid, self.view_of.get(tid, tid)))

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
                EventRecord(kind, phase, present, tensor, multiplicity, primitive)
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
        self._resolve_derived()
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
            grouped_convs=tuple(self.grouped_convs),
            key_values=key_value_pairs(self),
            matmul_operands=tuple(sorted(self.matmul_operands)),
            matmul_pairs=tuple(self.matmul_pairs),
            products=tuple(
                (out, *operands)
                for out, operands in sorted(self.unbatched_products.items())
            ),
            fused_products=product_images(self),
            casts=cast_pairs(self),
            relaid_operands=tuple(sorted(self.relaid_operands)),
            param_views=tuple(
                sorted(
                    (v, s)
                    for v, s in self.view_of.items()
                    if self.tensors[s].kind == "param"
                )
            ),
            residuals=kept_after_fusion(self),
            residuals_within_layers=kept_after_fusion(self, within_layers=True),
            accelerator_residuals=kept_after_fusion(self, accelerator=True),
            accelerator_residuals_within_layers=kept_after_fusion(
                self, within_layers=True, accelerator=True
            ),
            workspaces=tuple(sorted(self.workspaces.items())),
            poolings=tuple((t, out) for t, (out, _) in sorted(self.poolings.items())),
            other_residual_bytes=self.other_residual_bytes,
            tensor_layers=self.layers.scopes(len(self.tensors)),
            layer_inputs=tuple(sorted(self.layers.outside_inputs().items())),
            unread=tuple(
                t.id for t in tensors if t.kind == "param" and t.id not in self.readers
            ),
            param_readers=tuple(
                (t.id, tuple(sorted(self.readers[t.id])))
                for t in tensors
                if t.kind == "param" and t.id in self.readers
            ),
            input_readers=tuple(
                (t.id, tuple(sorted(self.readers[t.id] - {""})))
                for t in tensors
                if t.kind == "input" and t.id in self.readers
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

    def _final_events(self, class_of: dict[int, int]) -> tuple[CommEvent, ...]:
        return final_events(
            self.events,
            lambda elements: tuple(
                dict.fromkeys(class_of[self.uf.find(e)] for e in elements)
            ),
        )

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


# Primitives with a rule, for callers that want to report coverage.
HANDLED_PRIMITIVES = handled_primitives()
