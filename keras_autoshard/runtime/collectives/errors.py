"""The error every collective problem is reported as, and the argument checks
both backends share (so JAX and PyTorch reject the same calls alike)."""

from __future__ import annotations

from keras_autoshard.errors import CollectiveError  # noqa: F401

REDUCE_OPS = ("sum", "mean", "max")


def check_op(op: str, collective: str) -> None:
    """Raise `CollectiveError` unless `op` is one of `REDUCE_OPS`."""
    if op not in REDUCE_OPS:
        raise CollectiveError(
            f"{collective}: unknown reduction op={op!r}. Use one of {REDUCE_OPS}."
        )


def normalize_axis(axis: int, ndim: int, collective: str) -> int:
    """`axis` as a non-negative index into a tensor of rank `ndim`."""
    if not -ndim <= axis < ndim:
        raise CollectiveError(
            f"{collective}: axis={axis} is out of range for a tensor of rank "
            f"{ndim}. Pick an axis in [{-ndim}, {ndim})."
        )
    return axis % ndim


def check_divisible(
    shape: tuple[int, ...], axis: int, group_size: int, group: str, collective: str
) -> None:
    """Raise `CollectiveError` unless `shape[axis]` splits evenly `group_size`
    ways; `group` describes the ranks (a mesh axis or a process group)."""
    if shape[axis] % group_size:
        raise CollectiveError(
            f"{collective}: dimension {axis} of the input (shape {tuple(shape)}) "
            f"has size {shape[axis]}, which does not split evenly among the "
            f"{group_size} ranks of {group}. Pad or reshape the input so that "
            f"dimension {axis} is a multiple of {group_size}, or pass another "
            "axis=."
        )


def check_src(src: int, group_size: int, group: str, collective: str) -> None:
    """Raise `CollectiveError` unless `src` is a rank of a group of
    `group_size`."""
    if not 0 <= src < group_size:
        raise CollectiveError(
            f"{collective}: src={src} is not a rank of {group}, which has "
            f"{group_size} ranks. Pass src in [0, {group_size})."
        )
