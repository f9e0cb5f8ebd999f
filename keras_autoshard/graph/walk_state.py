"""The state of one jaxpr walk: `GraphBuilder` holds the tensors met, the
union-find of their dims, the communication events and slice edges the rules
record, and what each equation keeps for the backward pass (its residuals,
read by `graph/fusion.py`). The rules in `graph/jaxpr/` fill it through the
walker; `build()` hands it to `graph/assembly.py` for the final `AxisGraph`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from keras_autoshard.graph.assembly import assemble_axis_graph
from keras_autoshard.graph.axis_graph import (
    AxisGraph,
    DimSizeMismatchError,
    GroupedConv,
)
from keras_autoshard.graph.blocks import ScopeTracker
from keras_autoshard.graph.events import EventRecord
from keras_autoshard.graph.fusion import note_fusion
from keras_autoshard.graph.jaxpr.registry import ELEMENTWISE_PRIMITIVES
from keras_autoshard.graph.jaxpr.residuals import (
    STRUCTURAL_PRIMITIVES,
    ResidualsUnknown,
    residuals_of,
)
from keras_autoshard.graph.jaxpr.walker import aval_itemsize, aval_shape
from keras_autoshard.graph.layer_calls import CallReturns
from keras_autoshard.graph.union_find import UnionFind

logger = logging.getLogger(__name__)

# Max and min poolings: their backward passes need buffers of their operand's
# size (`AxisGraph.poolings`, `AxisGraph.workspaces`).
POOLINGS = frozenset({"reduce_window_max", "reduce_window_min"})
# Equations XLA fuses into their consumers (elementwise work and relabels).
FUSIBLE_PRIMITIVES = frozenset(ELEMENTWISE_PRIMITIVES) | {
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
}


@dataclasses.dataclass
class _TensorRecord:
    shape: tuple[int, ...]
    itemsize: int
    kind: str
    name: str | None
    elements: list[int | None]
    requires_grad: bool


class GraphBuilder:
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
        self.reduced_axes: dict[int, tuple[int, ...]] = {}  # reduction -> dims
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
        if name in POOLINGS and eqn.ins:
            self.poolings[eqn.ins[0]] = (outs[0], self.layers.current)
        if name not in STRUCTURAL_PRIMITIVES:
            note_fusion(
                self, name, name in FUSIBLE_PRIMITIVES, eqn.ins, outs, eqn.params
            )
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
        """The walk's `AxisGraph` (`graph/assembly.py`), once the derivative
        intermediates are resolved."""
        self._resolve_derived()
        return assemble_axis_graph(self)
