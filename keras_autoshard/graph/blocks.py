"""Which top-level layer made each tensor, and what each layer read.

Rematerialization works on whole layer calls: a layer wrapped in
`jax.checkpoint` keeps only its inputs for the backward pass and recomputes
the rest. To estimate that, the axis graph records, per tensor, the
top-level layer whose call made it (the first component of the JAX name
stack Keras enters per layer), and per top-level layer, the activations it
read from outside (what a checkpoint of its call keeps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class ScopeTracker:
    """Records producers and outside inputs of top-level layer calls.

    Example:

    ```python
    tracker = ScopeTracker()
    tracker.enter("transformer_layer_0/self_attention")
    tracker.record(ins=[3], outs=[4], is_activation=lambda t: True)
    tracker.outside_inputs()  # {"transformer_layer_0": (3,)}
    ```
    """

    def __init__(self) -> None:
        self.current = ""
        self.producer: dict[int, str] = {}
        self._inputs: dict[str, dict[int, None]] = {}

    def enter(self, name_stack: str) -> None:
        """The equations that follow run in the layer at `name_stack`.

        Args:
            name_stack: The JAX name stack of a top-level equation.
        """
        self.current = next((p for p in name_stack.split("/") if p), "")

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
        """The top-level layer of each of `count` tensors ("" for none)."""
        return tuple(self.producer.get(tid, "") for tid in range(count))

    def outside_inputs(self) -> dict[str, tuple[int, ...]]:
        """Top-level layer → the activations it read from other layers."""
        return {scope: tuple(tids) for scope, tids in self._inputs.items()}
