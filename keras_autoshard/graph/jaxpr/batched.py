"""Primitives batched over their leading dims: FFTs and linear algebra.

They compute on a few trailing "core" dims and treat every leading dim as a
batch of independent problems, exactly like an elementwise op does, so the
leading dims unify across operands and results (the batch can stay on the
data axis) while the core dims are unshardable. Allowed here, and only
here, because each of these primitives is documented by JAX/XLA as batched
over leading dims: `fft` (core: the `fft_lengths` dims), and `cholesky`,
`triangular_solve`, `lu`, `qr`, `eigh` and `svd` (core: the trailing matrix
dims). Any other primitive without a rule stays conservative (every dim it
touches unshardable, reported in the plan's notes).
"""

from __future__ import annotations

from keras_autoshard.graph.jaxpr.registry import primitive_rule
from keras_autoshard.graph.jaxpr.walker import Eqn

# Trailing core dims of the first operand, per primitive (fft: read from its
# parameters).
_MATRIX_CORE_DIMS = 2


def _first_operand_core_dims(e: Eqn) -> int:
    if e.name == "fft":
        return len(e.params["fft_lengths"])
    return _MATRIX_CORE_DIMS


@primitive_rule(
    "fft", "cholesky", "triangular_solve", "lu", "qr", "householder_product", "eigh",
    "svd",
)  # fmt: skip
def _rule_batched_over_leading_dims(e: Eqn) -> list[int]:
    outs = e.fresh_outputs()
    first = e.ins[0]
    batch_dims = max(0, e.rank(first) - _first_operand_core_dims(e))
    batch_shape = e.shape(first)[:batch_dims]
    reason = f"core dim of {e.name}"
    for tensor in [*e.ins, *outs]:
        leading = e.shape(tensor)[:batch_dims]
        shares_batch = leading == batch_shape and e.rank(tensor) >= batch_dims
        for dim in range(e.rank(tensor)):
            if shares_batch and dim < batch_dims:
                if tensor != first:
                    e.unify(first, dim, tensor, dim)
            else:
                e.mark(tensor, dim, reason)
    return outs
