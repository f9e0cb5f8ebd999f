"""Replica groups of a collective, in every form XLA prints them, expanded
to explicit device-id groups: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[8]`
(with an optional transpose `T(1,0)`), and the mesh / device-id forms;
`collective-permute` source-target pairs too."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from keras_autoshard.errors import HloParseError
from keras_autoshard.report.hlo.text import (
    Instruction,
    attribute_start,
    balanced_end,
    split_top_level,
)

# Kinds whose replica ids depend on `use_global_device_ids`; the others use
# partition ids when they carry a channel id and replica ids otherwise.
_GLOBAL_ID_KINDS = ("all-reduce", "all-gather", "reduce-scatter")


_INT_LIST = r"\d+(?:,\d+)*"


_IOTA_GROUPS = re.compile(
    rf"\[(?P<dims>{_INT_LIST})\]<=\[(?P<reshape>{_INT_LIST})\]"
    rf"(?:T\((?P<perm>{_INT_LIST})\))?"
)


_IOTA_DEVICE_IDS = re.compile(
    rf"^(?:\[{_INT_LIST}\]<=)?\[(?P<reshape>{_INT_LIST})\]"
    rf"(?:T\((?P<perm>{_INT_LIST})\))?$"
)


_MESH_AXIS = re.compile(r"^'?(?P<name>[^'=]+)'?=(?P<size>\d+)$")


_GROUP_AXIS = re.compile(r"^'?(?P<name>[^':]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?$")


@dataclasses.dataclass(frozen=True)
class DeviceSpace:
    """Replica and partition counts of the program being parsed."""

    num_replicas: int
    num_partitions: int

    @property
    def num_devices(self) -> int:
        return self.num_replicas * self.num_partitions


@dataclasses.dataclass(frozen=True)
class OpContext:
    """A collective instruction with what is needed to interpret it."""

    instruction: Instruction
    kind: str
    is_async: bool
    computation: str
    device_space: DeviceSpace

    def error(self, message: str) -> HloParseError:
        """An `HloParseError` that names the instruction."""
        return HloParseError(
            f"HLO instruction %{self.instruction.name} ({self.instruction.opcode} "
            f"in computation {self.computation}): {message}"
        )


def read_device_space(hlo_text: str, num_mesh_devices: int) -> DeviceSpace:
    """Reads `replica_count` and `num_partitions` from the module header.

    Args:
        hlo_text: HLO module text.
        num_mesh_devices: Number of devices of the mesh passed by the caller,
            used for `num_partitions` when the header does not print it.

    Returns:
        The replica and partition counts of the program.
    """
    header = next(
        (line for line in hlo_text.splitlines() if line.startswith("HloModule")),
        "",
    )
    replicas = re.search(r"\breplica_count=(\d+)", header)
    partitions = re.search(r"\bnum_partitions=(\d+)", header)
    num_replicas = int(replicas.group(1)) if replicas else 1
    if partitions:
        num_partitions = int(partitions.group(1))
    else:
        num_partitions = max(num_mesh_devices // num_replicas, 1)
    space = DeviceSpace(num_replicas, num_partitions)
    if space.num_devices != num_mesh_devices:
        raise HloParseError(
            f"The HLO module runs on {space.num_devices} devices "
            f"(replica_count={num_replicas}, num_partitions={num_partitions}) "
            f"but the mesh has {num_mesh_devices}."
        )
    return space


def read_replica_groups(context: OpContext) -> tuple[tuple[int, ...], ...]:
    """Returns the communicating groups as explicit global device ids.

    Args:
        context: A collective instruction with replica groups.

    Returns:
        The groups, in the order XLA prints them, after translating replica
        or partition ids to global device ids according to the collective's
        group mode (see `_group_mode`).
    """
    attributes = context.instruction.attributes
    start = attribute_start(attributes, "replica_groups")
    raw_groups = [] if start is None else _parse_group_value(attributes, start, context)
    mode = _group_mode(context)
    space = context.device_space
    id_limit = _id_limit(mode, space)
    if not raw_groups:
        raw_groups = [list(range(id_limit))]
    for group in raw_groups:
        if not group or max(group) >= id_limit:
            raise context.error(
                f"replica group {group} is not within ids 0..{id_limit - 1}."
            )
    return tuple(tuple(group) for group in _to_device_groups(raw_groups, mode, space))


def _group_mode(context: OpContext) -> str:
    """Returns how XLA interprets the ids in a collective's replica groups.

    Returns:
        `"flattened"` (global device ids), `"cross_partition"` (partition ids,
        repeated per replica), `"cross_replica"` (replica ids, repeated per
        partition) or `"cross_replica_and_partition"` (replica ids, each
        covering all partitions).
    """
    attributes = context.instruction.attributes
    has_channel = attribute_start(attributes, "channel_id") is not None
    if context.kind not in _GLOBAL_ID_KINDS:
        return "cross_partition" if has_channel else "cross_replica"
    if not has_channel:
        return "cross_replica"
    start = attribute_start(attributes, "use_global_device_ids")
    if start is not None and attributes.startswith("true", start):
        return "flattened"
    return "cross_replica_and_partition"


def _id_limit(mode: str, space: DeviceSpace) -> int:
    """Returns how many distinct ids the replica groups of a mode can use."""
    if mode == "flattened":
        return space.num_devices
    if mode == "cross_partition":
        return space.num_partitions
    return space.num_replicas


def _to_device_groups(
    groups: list[list[int]], mode: str, space: DeviceSpace
) -> list[list[int]]:
    """Translates replica or partition id groups to global device ids.

    The global id of (replica r, partition p) is `r * num_partitions + p`.
    """
    partitions = space.num_partitions
    if mode == "flattened":
        return groups
    if mode == "cross_partition":
        return [
            [replica * partitions + p for p in group]
            for replica in range(space.num_replicas)
            for group in groups
        ]
    if mode == "cross_replica":
        return [
            [r * partitions + partition for r in group]
            for partition in range(partitions)
            for group in groups
        ]
    return [
        [r * partitions + p for r in group for p in range(partitions)]
        for group in groups
    ]


def _parse_group_value(
    attributes: str, start: int, context: OpContext
) -> list[list[int]]:
    """Parses a `replica_groups=` value in any form XLA prints.

    Args:
        attributes: Attribute text of the instruction.
        start: Index where the value starts.
        context: The instruction, for error messages.

    Returns:
        The groups as lists of ids; an empty list for `{}` (all ids).

    Raises:
        HloParseError: For a form this parser does not know.
    """
    value = attributes[start:]
    if value.startswith("{"):
        return _parse_explicit_groups(value[: balanced_end(value, 0)], context)
    iota = _IOTA_GROUPS.match(value)
    if iota:
        return _iota_groups(iota, context)
    if value.startswith("mesh["):
        return _mesh_groups(value, context)
    raise context.error(f"unsupported replica_groups form {value[:60]!r}.")


def _parse_explicit_groups(text: str, context: OpContext) -> list[list[int]]:
    """Parses `{{0,1},{2,3}}` (or `{}`) into lists of ids."""
    compact = re.sub(r"\s+", "", text)
    if not re.fullmatch(r"\{(\{\d+(,\d+)*\}(,\{\d+(,\d+)*\})*)?\}", compact):
        raise context.error(f"cannot parse replica groups {text!r}.")
    return [
        [int(index) for index in group.split(",")]
        for group in re.findall(r"\{([\d,]+)\}", compact)
    ]


def _int_tuple(text: str | None) -> tuple[int, ...]:
    """Parses `"2,4"` into `(2, 4)`; None or empty gives `()`."""
    return tuple(int(value) for value in text.split(",")) if text else ()


def _iota_groups(iota: re.Match, context: OpContext) -> list[list[int]]:
    """Expands `[G,S]<=[dims]T(perm)` into G groups of S ids.

    The ids are an iota over `prod(dims)`, reshaped to `dims`, transposed by
    `perm` when given, then reshaped to `[G, S]`: rows are groups.
    """
    group_dims = _int_tuple(iota.group("dims"))
    reshape_dims = _int_tuple(iota.group("reshape"))
    perm = _int_tuple(iota.group("perm"))
    ids = _iota_array(reshape_dims, perm, context)
    if len(group_dims) != 2 or math.prod(group_dims) != ids.size:
        raise context.error(f"inconsistent iota replica groups {iota.group(0)!r}.")
    return ids.reshape(group_dims).tolist()


def _iota_array(
    reshape_dims: tuple[int, ...], perm: tuple[int, ...], context: OpContext
) -> np.ndarray:
    """Returns `arange(prod(dims)).reshape(dims).transpose(perm)`."""
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    if not perm:
        return ids
    if sorted(perm) != list(range(len(reshape_dims))):
        raise context.error(f"bad iota transpose {perm} for dims {reshape_dims}.")
    return ids.transpose(perm)


def _mesh_groups(value: str, context: OpContext) -> list[list[int]]:
    """Expands the mesh-axes form `mesh['a'=2,'b'=4] {'a'}` into groups.

    The optional `, device_ids=(...)` gives the mesh's device order (an iota
    such as `[2,2,2]T(0,2,1)` or an explicit id list). Grouped axes may be
    sub-axes `'a':(pre_size)size`. Devices are grouped by reshaping the mesh
    to split sub-axes, moving the grouped dimensions last and reading
    consecutive runs of the group size, as XLA does.
    """
    mesh_end = balanced_end(value, len("mesh"))
    names, sizes = _mesh_axes_spec(value[len("mesh") + 1 : mesh_end - 1], context)
    rest = value[mesh_end:]
    device_ids = np.arange(math.prod(sizes))
    ids_match = re.match(r"\s*,\s*device_ids=\(", rest)
    if ids_match:
        ids_end = balanced_end(rest, ids_match.end() - 1)
        device_ids = _mesh_device_ids(
            rest[ids_match.end() : ids_end - 1], sizes, context
        )
        rest = rest[ids_end:]
    axes_match = re.match(r"\s*\{", rest)
    if axes_match is None:
        raise context.error(f"cannot parse mesh replica groups {value[:80]!r}.")
    axes_end = balanced_end(rest, axes_match.end() - 1)
    axis_refs = _group_axis_refs(rest[axes_match.end() : axes_end - 1], names, context)
    return _groups_over_mesh_axes(device_ids, sizes, axis_refs, context)


def _mesh_axes_spec(
    text: str, context: OpContext
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Parses `'a'=2,'b'=4` into axis names and sizes."""
    names, sizes = [], []
    for _, piece in split_top_level(text):
        axis = _MESH_AXIS.match(piece.strip())
        if axis is None:
            raise context.error(f"cannot parse mesh axis {piece.strip()!r}.")
        names.append(axis.group("name"))
        sizes.append(int(axis.group("size")))
    if not names:
        raise context.error("the replica-group mesh has no axes.")
    return tuple(names), tuple(sizes)


def _mesh_device_ids(
    text: str, sizes: tuple[int, ...], context: OpContext
) -> np.ndarray:
    """Parses a mesh's `device_ids=(...)` into a flat array of device ids."""
    compact = re.sub(r"\s+", "", text)
    iota = _IOTA_DEVICE_IDS.match(compact)
    if iota:
        reshape_dims = _int_tuple(iota.group("reshape"))
        ids = _iota_array(reshape_dims, _int_tuple(iota.group("perm")), context)
    elif re.fullmatch(r"[\d,{}\[\]]+", compact):
        ids = np.array([int(value) for value in re.findall(r"\d+", compact)])
    else:
        raise context.error(f"cannot parse mesh device_ids {text!r}.")
    ids = ids.reshape(-1)
    if sorted(ids.tolist()) != list(range(math.prod(sizes))):
        raise context.error(f"mesh device_ids {text!r} do not match the mesh.")
    return ids


def _group_axis_refs(
    text: str, names: tuple[str, ...], context: OpContext
) -> list[tuple[int, tuple[int, int] | None]]:
    """Parses `'a','b':(2)2` into `(axis_index, (pre_size, size) or None)`."""
    refs = []
    for _, piece in split_top_level(text):
        axis = _GROUP_AXIS.match(piece.strip())
        if axis is None or axis.group("name") not in names:
            raise context.error(f"cannot parse replica-group axis {piece.strip()!r}.")
        sub_axis = None
        if axis.group("pre"):
            sub_axis = (int(axis.group("pre")), int(axis.group("size")))
        refs.append((names.index(axis.group("name")), sub_axis))
    if not refs:
        raise context.error("the mesh replica groups name no axes.")
    return refs


def _groups_over_mesh_axes(
    device_ids: np.ndarray,
    sizes: tuple[int, ...],
    axis_refs: list[tuple[int, tuple[int, int] | None]],
    context: OpContext,
) -> list[list[int]]:
    """Groups mesh devices that differ only along the referenced (sub-)axes.

    Args:
        device_ids: Flat device ids of the mesh, row-major over `sizes`.
        sizes: Mesh axis sizes.
        axis_refs: Grouped axes as `(axis_index, sub_axis)` pairs.
        context: The instruction, for error messages.

    Returns:
        The groups; within a group, ids vary fastest along the last grouped
        dimension.
    """
    split_sizes, grouped_dims = [], []
    for axis_index, axis_size in enumerate(sizes):
        refs = [sub for index, sub in axis_refs if index == axis_index]
        if not refs:
            split_sizes.append(axis_size)
            continue
        dims, aggregated = _split_mesh_axis(axis_size, refs, context)
        grouped_dims.extend(len(split_sizes) + dim for dim in aggregated)
        split_sizes.extend(dims)
    kept_dims = [dim for dim in range(len(split_sizes)) if dim not in grouped_dims]
    group_size = math.prod(split_sizes[dim] for dim in grouped_dims)
    ordered = device_ids.reshape(split_sizes).transpose(kept_dims + grouped_dims)
    return ordered.reshape(-1, group_size).tolist()


def _split_mesh_axis(
    axis_size: int, sub_axes: list[tuple[int, int] | None], context: OpContext
) -> tuple[list[int], list[int]]:
    """Splits one mesh axis so that each grouped sub-axis is a dimension.

    Args:
        axis_size: Size of the mesh axis.
        sub_axes: `(pre_size, size)` of each grouped sub-axis of this axis,
            or `[None]` when the whole axis is grouped.
        context: The instruction, for error messages.

    Returns:
        The sizes the axis is split into (major to minor) and the indices of
        the grouped ones, in the order the sub-axes were given.
    """
    if sub_axes == [None]:
        return [axis_size], [0]
    if None in sub_axes:
        raise context.error("a mesh axis is grouped both whole and in parts.")
    order = sorted(range(len(sub_axes)), key=lambda i: sub_axes[i][0])
    dims, dim_of_sub_axis, covered = [], {}, 1
    for sub_index in order:
        pre_size, size = sub_axes[sub_index]
        if pre_size % covered:
            raise context.error(f"overlapping sub-axes {sub_axes}.")
        if pre_size != covered:
            dims.append(pre_size // covered)
        dim_of_sub_axis[sub_index] = len(dims)
        dims.append(size)
        covered = pre_size * size
    if axis_size % covered:
        raise context.error(f"sub-axes {sub_axes} do not divide axis size {axis_size}.")
    if covered != axis_size:
        dims.append(axis_size // covered)
    return dims, [dim_of_sub_axis[i] for i in range(len(sub_axes))]


def source_target_pairs(context: OpContext) -> tuple[tuple[int, int], ...]:
    """Returns a collective-permute's pairs as global device ids."""
    attributes = context.instruction.attributes
    start = attribute_start(attributes, "source_target_pairs")
    if start is None or not attributes.startswith("{", start):
        raise context.error("it has no source_target_pairs.")
    text = attributes[start : balanced_end(attributes, start)]
    compact = re.sub(r"\s+", "", text)
    if not re.fullmatch(r"\{(\{\d+,\d+\}(,\{\d+,\d+\})*)?\}", compact):
        raise context.error(f"cannot parse source_target_pairs {text!r}.")
    pairs = [
        [int(source), int(target)]
        for source, target in re.findall(r"\{(\d+),(\d+)\}", compact)
    ]
    mode = _group_mode(context)
    space = context.device_space
    id_limit = _id_limit(mode, space)
    if pairs and max(max(pair) for pair in pairs) >= id_limit:
        raise context.error(f"source_target_pairs exceed ids 0..{id_limit - 1}.")
    return tuple(
        (source, target) for source, target in _to_device_groups(pairs, mode, space)
    )
