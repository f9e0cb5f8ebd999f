"""The table of primitive rules: each rule registers itself where it is
defined, with `@primitive_rule("name", ...)`; the walker looks rules up here.

Adding a primitive touches one file: the family module that defines its rule.
"""

from __future__ import annotations

from collections.abc import Callable

_RULES: dict[str, Callable] = {}

ELEMENTWISE_PRIMITIVES = (
    "abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp "
    "complex conj convert_element_type copy copy_p cos cosh digamma div eq erf "
    "erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag integer_pow "
    "is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or "
    "polygamma population_count pow real reduce_precision rem round rsqrt "
    "select_n sign sin sinh sqrt square stop_gradient sub tan tanh xor clz "
    "bessel_i0e bessel_i1e zeta"
).split()

RANDOM_PRIMITIVES = (
    "random_seed random_bits random_split random_fold_in random_wrap "
    "random_unwrap random_clone threefry2x32 shift_left shift_right_logical "
    "shift_right_arithmetic mulhi rng_bit_generator rng_uniform"
).split()


def primitive_rule(*primitives: str) -> Callable[[Callable], Callable]:
    """Register the decorated rule for `primitives`.

    Args:
        *primitives: JAX primitive names the rule handles.

    Returns:
        A decorator that registers and returns the rule.

    Example:

    ```python
    @primitive_rule("tile")
    def tile_rule(e):
        ...
    ```
    """

    def register(rule: Callable) -> Callable:
        for name in primitives:
            if name in _RULES:
                raise ValueError(
                    f"Primitive {name!r} already has the rule {_RULES[name].__name__}."
                )
            _RULES[name] = rule
        return rule

    return register


def rule_for(primitive: str) -> Callable | None:
    """The rule registered for `primitive`, or `None`."""
    return _RULES.get(primitive)


def handled_primitives() -> frozenset[str]:
    """Every primitive name with a registered rule."""
    return frozenset(_RULES)
