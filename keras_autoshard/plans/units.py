"""Byte sizes as people write them: read (`16GiB`, `80GB`, `512MiB`,
`1073741824`) and written (`1.50 MiB`)."""

from __future__ import annotations

import re

from keras_autoshard.errors import PlanError

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_BYTE_SIZE = re.compile(
    r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]*)\s*$"
)


def byte_size(value: int | float | str) -> int:
    """A size in bytes from a number or a string such as `"16GiB"`.

    Binary units (KiB, MiB, GiB, TiB, and K, M, G, T) and decimal ones (KB,
    MB, GB, TB), case-insensitive; a bare number is bytes.

    Args:
        value: Bytes (a non-negative number) or a size string.

    Returns:
        The size in bytes.

    Raises:
        PlanError: for anything else, naming the value.

    Example:

    ```python
    byte_size("1.5GiB")  # 1610612736
    byte_size("80GB")    # 80000000000
    byte_size(2**30)     # 1073741824
    ```
    """
    if isinstance(value, bool):
        raise PlanError(
            f"A size must be bytes or a string like '16GiB', got {value!r}."
        )
    if isinstance(value, (int, float)):
        if value < 0 or value != value:
            raise PlanError(f"A size must be >= 0 bytes, got {value!r}.")
        return int(value)
    if isinstance(value, str):
        match = _BYTE_SIZE.match(value)
        unit = match.group("unit").lower() if match else None
        if match is not None and unit in _BYTE_UNITS:
            return int(float(match.group("number")) * _BYTE_UNITS[unit])
    raise PlanError(
        f"A size must look like 16GiB, 512MiB, 80GB or 1073741824 (bytes), got "
        f"{value!r}."
    )


def optional_byte_size(value: int | float | str | None) -> int | None:
    """`byte_size(value)`, or `None` for `None` (no budget)."""
    return None if value is None else byte_size(value)


def format_bytes(num_bytes: float) -> str:
    """A byte count as people read it, in binary units.

    Args:
        num_bytes: Bytes.

    Returns:
        Whole bytes below 1 KiB, else two decimals of the largest unit up to
        TiB.

    Example:

    ```python
    format_bytes(1536)       # '1.50 KiB'
    format_bytes(2**30 * 3)  # '3.00 GiB'
    format_bytes(12)         # '12 B'
    ```
    """
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
