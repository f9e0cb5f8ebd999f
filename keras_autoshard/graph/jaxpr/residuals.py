"""Which tensors of the forward pass the backward pass keeps (residuals).

Automatic differentiation keeps, for each equation, the values its
derivative needs: both operands of a product, the output of `exp` or `tanh`,
nothing for an addition or a reshape. Rather than restate JAX's derivative
rules here, each equation's residuals are read from JAX itself
(`saved_residuals` of the primitive alone, with the equation's shapes and
the operands that carry no gradient behind `stop_gradient`), cached per
primitive, parameters, shapes and gradient pattern, and mapped back to the
equation's own input and output tensors, so that the planner knows each
residual's axis classes and therefore its bytes on one device under any
sharding.

Structural primitives (calls, custom derivatives, loops) are not asked:
their bodies are walked and their equations answer for them. A custom JVP
call (`jax.nn.softmax`, `jax.nn.relu`) is the exception: its own derivative
rule decides what it keeps (a softmax keeps its output, not the exponentials
of its body), so the call is asked as a whole (`call_residuals`) and its
body's equations keep nothing.

A primitive JAX cannot differentiate alone (no derivative rule) raises
`ResidualsUnknown`, which carries the conservative answer (every operand
with a gradient kept) for the caller to use and to say so in the graph's
notes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from keras_autoshard.compat import jax_private

# Primitives whose bodies the walker walks: their equations carry the
# residuals (a call keeps nothing of its own).
STRUCTURAL_PRIMITIVES = frozenset(
    {
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat",
        "checkpoint",
        "scan",
        "while",
        "cond",
        "shard_map",
        "xla_call",
    }
)

# Calls asked as a whole: their derivative rule, not their body, decides.
OWN_RULE_CALLS = frozenset({"custom_jvp_call"})

_ARGUMENT = re.compile(r"from the argument args\[(\d+)\]")


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value an equation keeps for the backward pass.

    Args:
        side: `"in"` (an operand), `"out"` (an output) or `"other"` (an
            intermediate of the derivative with no tensor of its own).
        index: The operand's or output's position; for `"other"`, the
            position of the tensor with the same element count whose cut it
            shares, or -1 for none (then counted whole on every device).
        nbytes: Its bytes (whole, unsharded).
        derived: An intermediate of the derivative (not the equation's own
            output nor an operand: `2 x` for `x ** 2`, `s (1 - s)` for a
            sigmoid), tied by shape to `index`.
    """

    side: str
    index: int
    nbytes: int
    derived: bool = False


class ResidualsUnknown(Exception):
    """JAX cannot tell what an equation keeps; `assumed` is the fallback.

    Args:
        primitive: The equation's primitive name.
        assumed: The residuals assumed: every operand that carries a
            gradient, kept whole.
        reason: First line of JAX's error.
    """

    def __init__(
        self, primitive: str, assumed: tuple[Residual, ...], reason: str
    ) -> None:
        super().__init__(f"residuals of {primitive} unknown to JAX ({reason})")
        self.primitive = primitive
        self.assumed = assumed
        self.reason = reason

    def note(self, layer: str = "") -> str:
        """The graph note: the primitive, the layer (if any), the guess."""
        where = f" in layer {layer!r}" if layer else ""
        return f"{self}{where}: its operands are assumed kept for the backward pass"


def residuals_of(
    eqn, params: dict[str, Any], grads: Sequence[bool]
) -> tuple[Residual, ...]:
    """What the equation `eqn` keeps: a call with its own derivative rule
    asked as a whole (`call_residuals`), any other primitive alone
    (`equation_residuals`).

    Raises:
        ResidualsUnknown: as `equation_residuals`.
    """
    if eqn.primitive.name in OWN_RULE_CALLS:
        return call_residuals(eqn, grads)
    in_avals = [atom.aval for atom in eqn.invars]
    return equation_residuals(eqn.primitive, params, in_avals, grads)


def equation_residuals(
    primitive, params: dict[str, Any], in_avals: Sequence[Any], grads: Sequence[bool]
) -> tuple[Residual, ...]:
    """What one equation keeps for its derivative.

    Args:
        primitive: The equation's primitive.
        params: Its parameters.
        in_avals: Its operands' abstract values.
        grads: Whether each operand carries a gradient.

    Returns:
        The residuals (none when no operand carries a gradient).

    Raises:
        ResidualsUnknown: JAX cannot differentiate the primitive alone; it
            holds the residuals assumed instead.
    """
    if primitive.name in STRUCTURAL_PRIMITIVES or not any(grads):
        return ()
    if primitive.name in _FUSED_ATTENTION:
        return _fused_attention_residuals(params, in_avals, grads)
    try:
        key = (
            primitive,
            _hashable(params),
            tuple((tuple(a.shape), str(a.dtype)) for a in in_avals),
            tuple(bool(g) for g in grads),
        )
        hash(key)
    except TypeError:
        return _known(
            primitive.name, _queried(primitive, params, tuple(in_avals), tuple(grads))
        )
    found = _CACHE.get(key)
    if found is None:
        found = _queried(primitive, params, tuple(in_avals), key[3])
        _CACHE[key] = found
    return _known(primitive.name, found)


# cuDNN's fused attention forward (`graph/jaxpr/fused_attention.py`) has no
# derivative rule of its own (its custom VJP's forward rule decides), so
# JAX cannot be asked about it alone; what that rule saves is stated here.
_FUSED_ATTENTION = frozenset(
    {"dot_product_attention_fwd_wrapper", "dot_product_attention_fwd"}
)


def _fused_attention_residuals(
    params: dict[str, Any], in_avals: Sequence[Any], grads: Sequence[bool]
) -> tuple[Residual, ...]:
    """What `_dot_product_attention_fwd_rule` (jax/_src/cudnn) saves: the
    query, key, value and bias, the output, and the softmax statistics
    (float32, one per batch row, head and query position)."""
    kept = [
        Residual("in", index, _nbytes(in_avals[index]))
        for index in range(4)
        if index < len(in_avals) and _nbytes(in_avals[index]) > 0
    ]
    query = in_avals[0]
    kept.append(Residual("out", 0, _nbytes(query)))
    rows = int(np.prod(query.shape[:-1], dtype=np.int64))
    kept.append(Residual("other", -1, rows * 4, derived=True))
    return tuple(kept)


# Residuals, and why JAX could not tell them (None when it could).
_Answer = tuple[tuple[Residual, ...], str | None]
_CACHE: dict[Any, _Answer] = {}


def _known(primitive_name: str, answer: _Answer) -> tuple[Residual, ...]:
    """The residuals of `answer`, or `ResidualsUnknown` with the fallback."""
    residuals, unknown_reason = answer
    if unknown_reason is not None:
        raise ResidualsUnknown(primitive_name, residuals, unknown_reason)
    return residuals


def call_residuals(eqn, grads: Sequence[bool]) -> tuple[Residual, ...]:
    """What a call equation with its own derivative rule (a custom JVP call)
    keeps, asked of JAX for the call as a whole.

    Args:
        eqn: The `JaxprEqn` of the call.
        grads: Whether each operand carries a gradient.

    Returns:
        The residuals, as `equation_residuals` gives them.

    Raises:
        ResidualsUnknown: as `equation_residuals`.
    """
    if not any(grads):
        return ()
    in_avals = tuple(atom.aval for atom in eqn.invars)
    key = (
        eqn.primitive,
        str(eqn.params.get("call_jaxpr")),
        tuple((tuple(a.shape), str(a.dtype)) for a in in_avals),
        tuple(bool(g) for g in grads),
    )
    found = _CACHE.get(key)
    if found is None:
        found = _queried(_bind_equation(eqn), None, in_avals, key[3])
        _CACHE[key] = found
    return _known(eqn.primitive.name, found)


def _bind_equation(eqn):
    """A primitive-like object whose `bind` evaluates `eqn` alone on new
    operands (literal operands stay literals)."""
    from jax.extend import core as jcore

    variables = [
        jcore.Var(atom.aval) if isinstance(atom, jcore.Var) else atom
        for atom in eqn.invars
    ]
    one = eqn.replace(invars=variables)
    operands = [v for v in variables if isinstance(v, jcore.Var)]
    # JAX deprecates a Jaxpr without debug info; this one has no Python
    # function behind it, so its names are unknown (None).
    debug_info = jcore.DebugInfo("residuals", eqn.primitive.name, None, None)
    jaxpr = jcore.Jaxpr([], operands, list(one.outvars), [one], debug_info=debug_info)
    run = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, []))

    class _Equation:
        name = eqn.primitive.name

        @staticmethod
        def bind(*args, **_):
            kept = [a for a, v in zip(args, variables) if isinstance(v, jcore.Var)]
            outs = run(*kept)
            return outs if eqn.primitive.multiple_results else outs[0]

    return _Equation


def _queried(primitive, params, in_avals, grads) -> _Answer:
    structs = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in in_avals]

    def alone(*args):
        held = [
            a if g and _inexact(a) else jax.lax.stop_gradient(a)
            for a, g in zip(args, grads)
        ]
        return primitive.bind(*held, **(params or {}))

    try:
        out_avals = jax.eval_shape(alone, *structs)
        found = jax_private.saved_residuals(alone, *structs)
    except Exception as error:  # noqa: BLE001 - any primitive JAX cannot bind alone
        # Every operand with a gradient kept; the caller notes the guess.
        assumed = tuple(
            Residual("in", i, _nbytes(a))
            for i, (a, g) in enumerate(zip(in_avals, grads))
            if g and _inexact(a)
        )
        lines = str(error).strip().splitlines()
        return assumed, f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
    outs = jax.tree_util.tree_leaves(out_avals)
    residuals = []
    for aval, description in found:
        nbytes = _nbytes(aval)
        match = _ARGUMENT.search(description)
        if match:
            residuals.append(Residual("in", int(match.group(1)), nbytes))
            continue
        if "from a literal" in description or "from a constant" in description:
            continue
        if description.startswith("output of stop_gradient "):
            # An operand that carries no gradient, as `alone` passed it.
            held = _held_operand(aval, in_avals, grads)
            if held is not None:
                residuals.append(Residual("in", held, nbytes))
                continue
        matched = _matched(aval, nbytes, outs, in_avals)
        own_output = description.startswith(f"output of {primitive.name} ")
        residuals.append(dataclasses.replace(matched, derived=not own_output))
    return tuple(residuals), None


def _held_operand(aval, in_avals, grads) -> int | None:
    """The operand without a gradient (passed through `stop_gradient`) that
    a residual of `aval`'s shape and dtype is: a select's predicate."""
    for index, (candidate, grad) in enumerate(zip(in_avals, grads)):
        if grad and _inexact(candidate):
            continue
        if tuple(candidate.shape) == tuple(aval.shape) and str(candidate.dtype) == str(
            aval.dtype
        ):
            return index
    return None


def _matched(aval, nbytes: int, outs, ins) -> Residual:
    """An intermediate residual, tied to an output or operand of its shape
    (else of its element count) so that it shares that tensor's cut."""
    shape = tuple(aval.shape)
    for side, candidates in (("out", outs), ("in", ins)):
        for index, candidate in enumerate(candidates):
            if tuple(candidate.shape) == shape:
                return Residual(side, index, nbytes)
    count = int(np.prod(shape, dtype=np.int64))
    for side, candidates in (("out", outs), ("in", ins)):
        for index, candidate in enumerate(candidates):
            if int(np.prod(candidate.shape, dtype=np.int64)) == count:
                return Residual(side, index, nbytes)
    return Residual("other", -1, nbytes)


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _inexact(aval) -> bool:
    return bool(jax.dtypes.issubdtype(aval.dtype, np.inexact))


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, np.ndarray):
        return (value.shape, str(value.dtype), value.tobytes())
    return value
