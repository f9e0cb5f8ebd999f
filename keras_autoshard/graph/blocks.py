"""Which layer call (unit) made each tensor, and what each unit read.

Rematerialization works on whole layer calls: a layer wrapped in
`jax.checkpoint` keeps only its inputs for the backward pass and recomputes
the rest. To estimate that, the axis graph records, per tensor, the unit
whose call made it, and per unit, the activations it read from outside
(what a checkpoint of its call keeps).

A unit is a layer at the shallowest level of the JAX name stack (the layer
paths Keras enters per call) where copies of a layer sit side by side
(`transformer_layer_0`, `transformer_layer_1`: one stem, `scope_stem`):
the top-level layers of a backbone, and the backbone's own layers when a
model wraps it (a KerasHub task around its backbone, a wrapper calling one
model), named by their path (`gpt2_backbone/transformer_layer_0`). A
layer path below no such level keeps its first component.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

_INDEXED_SCOPE = re.compile(r"^(?P<stem>.*?)(?P<index>\d+)$")


def scope_stem(scope: str) -> str:
    """The name a layer scope shares with its copies: `transformer_layer_`
    for `transformer_layer_3`; Keras names copies `block`, `block_1`,
    `block_2` (the first has no index), so `block_` for `block`.

    Args:
        scope: A layer scope name.

    Returns:
        Its stem.
    """
    match = _INDEXED_SCOPE.match(scope)
    return match.group("stem") if match else f"{scope}_"


def scope_index(scope: str) -> int:
    """The copy index of a layer scope (-1 for an unnumbered first copy)."""
    match = _INDEXED_SCOPE.match(scope)
    return int(match.group("index")) if match else -1


def unit_namer(name_stacks: Iterable[str]) -> Callable[[str], str]:
    """The unit of each name stack, from all the name stacks of a trace.

    Args:
        name_stacks: The JAX name stacks of the trace's top-level equations.

    Returns:
        A function from a name stack to its unit ("" for an empty stack).

    Example:

    ```python
    unit_of = unit_namer(["lm/block/dense", "lm/block_1/dense", "lm/norm"])
    unit_of("lm/block_1/dense")  # "lm/block_1"
    unit_of("lm/norm")           # "lm/norm"
    ```
    """
    children: dict[tuple[str, ...], set[str]] = {}
    for stack in name_stacks:
        parts = _parts(stack)
        for depth in range(len(parts)):
            children.setdefault(parts[:depth], set()).add(parts[depth])
    with_copies = {
        parent
        for parent, names in children.items()
        if len({scope_stem(name) for name in names}) < len(names)
    }

    def unit_of(name_stack: str) -> str:
        parts = _parts(name_stack)
        for depth in range(len(parts)):
            if parts[:depth] in with_copies:
                return "/".join(parts[: depth + 1])
        return parts[0] if parts else ""

    return unit_of


def _parts(name_stack: str) -> tuple[str, ...]:
    return tuple(part for part in name_stack.split("/") if part)


class ScopeTracker:
    """Records producers and outside inputs of unit calls.

    Args:
        unit_of: Name stack → unit (`unit_namer`); by default, its first
            component.

    Example:

    ```python
    tracker = ScopeTracker()
    tracker.enter("transformer_layer_0/self_attention")
    tracker.record(ins=[3], outs=[4], is_activation=lambda t: True)
    tracker.outside_inputs()  # {"transformer_layer_0": (3,)}
    ```
    """

    def __init__(self, unit_of: Callable[[str], str] | None = None) -> None:
        self.current = ""
        self.producer: dict[int, str] = {}
        self._inputs: dict[str, dict[int, None]] = {}
        self._unit_of = unit_of or (lambda stack: next(iter(_parts(stack)), ""))

    def enter(self, name_stack: str) -> None:
        """The equations that follow run in the unit of `name_stack`.

        Args:
            name_stack: The JAX name stack of a top-level equation.
        """
        self.current = self._unit_of(name_stack)

    def record(
        self,
        ins: Sequence[int],
        outs: Sequence[int],
        is_activation: Callable[[int], bool],
    ) -> None:
        """Note that the current layer made `outs` from `ins`.

        Args:
            ins: Tensor ids the equation reads.
            outs: Tensor ids it makes.
            is_activation: Whether a tensor id is an activation (not a
                parameter, input or constant).
        """
        for tid in outs:
            self.producer.setdefault(tid, self.current)
        if not self.current:
            return
        for tid in ins:
            if self.producer.get(tid, "") != self.current and is_activation(tid):
                self._inputs.setdefault(self.current, {})[tid] = None

    def scopes(self, count: int) -> tuple[str, ...]:
        """The unit of each of `count` tensors ("" for none)."""
        return tuple(self.producer.get(tid, "") for tid in range(count))

    def outside_inputs(self) -> dict[str, tuple[int, ...]]:
        """Unit → the activations it read from other units."""
        return {scope: tuple(tids) for scope, tids in self._inputs.items()}
