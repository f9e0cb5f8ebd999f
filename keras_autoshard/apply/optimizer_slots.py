"""Which parameter an optimizer slot belongs to, from Keras's slot names
(backend-neutral)."""

from __future__ import annotations

from typing import Any


def slot_prefix(path: str) -> str:
    """The prefix Keras gives the optimizer slots of the variable at `path`."""
    return path.replace("/", "_")


def slot_owner(slot, owners: dict[str, tuple[Any, Any]]) -> tuple[Any, Any] | None:
    """The (parameter, payload) pair an optimizer slot was made from.

    Keras names slots `<parameter path with / as _>_<slot name>`; the owner is
    the longest matching prefix whose variable has the slot's shape.

    Args:
        slot: An optimizer variable.
        owners: `slot_prefix(parameter.path)` → (parameter, payload).

    Returns:
        The owner's (parameter, payload), or `None` for variables that belong
        to no parameter (the iteration counter, the learning rate).
    """
    name = slot.name
    best = None
    for prefix, (variable, payload) in owners.items():
        if name.startswith(prefix + "_") and tuple(slot.shape) == tuple(variable.shape):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, (variable, payload))
    return None if best is None else best[1]
