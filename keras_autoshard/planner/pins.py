"""Choices fixed before the search, from user rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Pins:
    """Choices fixed before the search (from user rules).

    Args:
        class_axis: Class id → mesh axis name, or None to forbid sharding it.
        fsdp: Parameter name → ((dim, axis), ...) storage sharding to force.
        no_fsdp: Parameter names whose storage must follow `class_axis` only.
    """

    class_axis: Mapping[int, str | None] = dataclasses.field(default_factory=dict)
    fsdp: Mapping[str, tuple[tuple[int, str], ...]] = dataclasses.field(
        default_factory=dict
    )
    no_fsdp: frozenset[str] = frozenset()
