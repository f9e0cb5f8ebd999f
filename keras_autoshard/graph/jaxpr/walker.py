"""The jaxpr walker: binds jaxpr variables to tensors of the graph being built
and dispatches each equation to the rule registered for its primitive
(`registry.py`); a primitive with no rule makes every dim it touches
unshardable."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.extend import core as jcore

from keras_autoshard.graph.axis_graph import JOINED
from keras_autoshard.graph.jaxpr.registry import rule_for

if TYPE_CHECKING:
    from keras_autoshard.graph.walk_state import GraphBuilder

logger = logging.getLogger(__name__)


NO_GRAD_PRIMITIVES = frozenset({"stop_gradient", "floor", "ceil", "round", "sign"})


def aval_shape(aval: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(aval, "shape", ()))


def aval_itemsize(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return int(getattr(dtype, "itemsize", 0))


def has_grad(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, np.inexact))
    except TypeError:
        return False


@dataclasses.dataclass
class Eqn:
    """One equation being walked, with its input tensor ids."""

    eqn: jcore.JaxprEqn
    ins: list[int]
    multiplicity: int
    builder: GraphBuilder
    walker: Walker

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
        grad_out = grad_in and self.name not in NO_GRAD_PRIMITIVES
        return [
            self.builder.new_tensor(
                var.aval, "activation", requires_grad=grad_out and has_grad(var.aval)
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

    @property
    def layer(self) -> str:
        """The Keras layer path this equation was traced in ("" if none)."""
        return str(self.eqn.source_info.name_stack)

    def _where(self, reason: str) -> str:
        """`reason` with the layer named, so notes say where it happened."""
        if not self.layer or " in layer " in reason:
            return reason
        return f"{reason} in layer {self.layer!r}"

    def mark(self, tid: int, dim: int, reason: str) -> None:
        self.builder.mark(tid, dim, self._where(reason))

    def mark_all(self, tid: int, reason: str) -> None:
        self.builder.mark_all(tid, self._where(reason))

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

    def joined_edge(self, operand: int, dim: int, out: int, out_dim: int) -> None:
        """Operand `dim` is one of equal parts joined into (or split from)
        `out_dim`: both may be cut over an axis, at the price of moving the
        rows between devices (`SliceEdge.joined`)."""
        reason = f"{JOINED} {self.name}"
        self.builder.add_slice_edge((operand, dim), (out, out_dim), reason)


def _positional_word(primitive: str) -> str:
    words = {"pad": "padded", "concatenate": "concatenated", "tile": "tiled"}
    return words.get(primitive, "sliced")


Rule = Callable[[Eqn], list[int]]


VIEW_PRIMITIVES = frozenset({"convert_element_type", "copy", "copy_p"})


class Walker:
    """Walks jaxprs, dispatching each equation to its primitive's rule."""

    def __init__(self, builder: GraphBuilder) -> None:
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
                walked = Eqn(eqn, ins, multiplicity, self.builder, self)
                if self._depth == 1:
                    self.builder.layers.enter(str(eqn.source_info.name_stack))
                outs = self._apply(walked)
                self.builder.record_residuals(walked, outs)
                env.update(zip(eqn.outvars, outs))
                if self._depth == 1:
                    name_stack = str(eqn.source_info.name_stack)
                    self.builder.calls.record(name_stack, ins, outs)
                    if outs:
                        self.builder.record_scope(name_stack, outs)
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

    def _apply(self, eqn: Eqn) -> list[int]:
        rule = rule_for(eqn.name)
        if rule is None:
            return self.unknown(eqn)
        return rule(eqn)

    def unknown(self, eqn: Eqn, why: str | None = None) -> list[int]:
        """Conservative fallback: every dim touched becomes unshardable."""
        layer = str(eqn.eqn.source_info.name_stack)
        where = f" in layer {layer!r}" if layer else ""
        reason = why or f"unknown primitive '{eqn.name}'{where}"
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
