"""Communication events as the walk records them, and as the graph keeps them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from keras_autoshard.graph.axis_graph import CommEvent


@dataclasses.dataclass
class EventRecord:
    """One use's communication, in tensor elements (before classes exist)."""

    kind: str
    phase: str
    elements: tuple[int, ...]
    tensor: int
    multiplicity: int
    primitive: str


def final_events(
    records: Sequence[EventRecord],
    classes_of: Callable[[Sequence[int]], tuple[int, ...]],
) -> tuple[CommEvent, ...]:
    """The graph's `CommEvent`s: every forward record as it is, and one
    backward event per (tensor, multiplicity): a gradient is the sum of its
    uses' contributions (each use's classes kept in `CommEvent.uses`).

    Args:
        records: The walk's records, in order.
        classes_of: Elements -> their distinct class ids, in order.

    Returns:
        The events.
    """
    forward = [
        CommEvent(
            kind=r.kind,
            phase=r.phase,
            classes=classes_of(r.elements),
            tensor=r.tensor,
            multiplicity=r.multiplicity,
            primitive=r.primitive,
        )
        for r in records
        if r.phase == "forward"
    ]
    groups: dict[tuple[int, int], list[EventRecord]] = {}
    for record in records:
        if record.phase == "backward":
            groups.setdefault((record.tensor, record.multiplicity), []).append(record)
    backward = [
        CommEvent(
            kind=group[0].kind,
            phase="backward",
            classes=classes_of([e for r in group for e in r.elements]),
            tensor=tensor,
            multiplicity=multiplicity,
            primitive="+".join(dict.fromkeys(r.primitive for r in group)),
            uses=tuple(classes_of(r.elements) for r in group) if len(group) > 1 else (),
        )
        for (tensor, multiplicity), group in groups.items()
    ]
    return tuple(forward) + tuple(backward)
