"""Exact inventory of the collective operations in optimized HLO text.

The functions here read the text of a compiled SPMD program, as printed by
`jax.jit(f).lower(*args).compile().as_text()`, and return one record per
collective instruction: its kind, the bytes it moves per device, its replica
groups expanded to explicit device ids, and the mesh axes those groups span.

The module is pure Python (stdlib and numpy): it never imports JAX, so
reports can be produced from saved HLO dumps.

Conventions:

- Device ids are the flattened (row-major) positions in the mesh's device
  array, which is how JAX assigns partition ids when compiling over a
  `jax.sharding.Mesh`.
- Counts are static: an instruction inside a loop body is listed once.
- An async pair (`all-reduce-start`/`all-reduce-done`, ...) is listed once,
  under the name of its `-start` instruction.
- Mesh axes of size 1 are never reported, since a group cannot vary along
  them.
"""

import collections
import dataclasses
import math
import re
from collections.abc import Mapping

import numpy as np

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)

_PAIRED_SUFFIXES = ("-start", "-done")

# Kinds whose replica ids depend on `use_global_device_ids`; the others use
# partition ids when they carry a channel id and replica ids otherwise.
_GLOBAL_ID_KINDS = ("all-reduce", "all-gather", "reduce-scatter")

_DTYPE_BITS = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "f4e2m1fn": 4,
    "token": 0,
    "opaque": 0,
}

_OPENERS = "([{"
_CLOSERS = ")]}"

_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_INSTRUCTION_HEAD = re.compile(r"^\s+(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*")
_COMPUTATION_HEAD = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*(?:\(.*)?\{\s*$")
_ARRAY_SHAPE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][a-z0-9\-]*)\(")
_LAYOUT_ELEMENT_BITS = re.compile(r"E\((\d+)\)")
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
class CollectiveOp:
    """One collective instruction of a compiled HLO module.

    Args:
        kind: One of `COLLECTIVE_KINDS`, e.g. `"all-reduce"`; async
            `-start`/`-done` pairs report the base kind.
        name: HLO instruction name, e.g. `"all-reduce.2"` (the `-start`
            instruction for an async pair).
        computation: Name of the HLO computation that contains it.
        operand_bytes: Bytes of all operands on one device, summed over
            variadic and tuple operands.
        result_bytes: Bytes of the result on one device, summed over tuple
            elements (for async pairs, the `-done` result).
        operand_shapes: Shapes of the operands without layouts, e.g.
            `("f32[8,16]", "f32[16,8]")`.
        replica_groups: Groups of device ids that communicate, expanded to
            explicit ids. For `collective-permute`, the connected components
            of the source-target pairs.
        mesh_axes: Mesh axis names, in mesh order, that the groups span;
            `None` when the groups match no subset of mesh axes.
        result_shapes: Shapes of the result elements without layouts.
        source_target_pairs: `(source, target)` device ids of a
            `collective-permute`; empty for the other kinds.
        is_async: Whether the op was printed as a `-start`/`-done` pair.

    Example:

    ```python
    ops = parse_collectives(hlo_text, (2, 4), ("batch", "model"))
    ops[0].kind, ops[0].mesh_axes, ops[0].operand_bytes
    # ("all-reduce", ("model",), 512)
    ```
    """

    kind: str
    name: str
    computation: str
    operand_bytes: int
    result_bytes: int
    operand_shapes: tuple[str, ...]
    replica_groups: tuple[tuple[int, ...], ...]
    mesh_axes: tuple[str, ...] | None
    result_shapes: tuple[str, ...] = ()
    source_target_pairs: tuple[tuple[int, int], ...] = ()
    is_async: bool = False

    def to_dict(self) -> dict:
        """Returns the op as a JSON-serializable dict.

        Returns:
            A dict with one key per field; tuples become lists and
            `mesh_axes` stays `None` when it is not derivable.

        Example:

        >>> op = CollectiveOp("all-reduce", "ar", "main", 4, 4, ("f32[]",),
        ...                   ((0, 1),), ("model",))
        >>> op.to_dict()["replica_groups"]
        [[0, 1]]
        """
        return {
            "kind": self.kind,
            "name": self.name,
            "computation": self.computation,
            "operand_bytes": self.operand_bytes,
            "result_bytes": self.result_bytes,
            "operand_shapes": list(self.operand_shapes),
            "replica_groups": [list(group) for group in self.replica_groups],
            "mesh_axes": None if self.mesh_axes is None else list(self.mesh_axes),
            "result_shapes": list(self.result_shapes),
            "source_target_pairs": [list(pair) for pair in self.source_target_pairs],
            "is_async": self.is_async,
        }


@dataclasses.dataclass(frozen=True)
class _ArrayShape:
    """A dense array shape: dtype, dimension sizes and packed element bits."""

    dtype: str
    dims_text: str
    num_elements: int
    packed_bits: int | None

    @property
    def text(self) -> str:
        return f"{self.dtype}[{self.dims_text}]"


@dataclasses.dataclass(frozen=True)
class _Instruction:
    """The parts of one HLO instruction line this module needs."""

    name: str
    shape_text: str
    opcode: str
    operands_text: str
    attributes: str


@dataclasses.dataclass(frozen=True)
class _Computation:
    """An HLO computation: its name and instructions in printed order."""

    name: str
    instructions: tuple[_Instruction, ...]


@dataclasses.dataclass(frozen=True)
class _DeviceSpace:
    """Replica and partition counts of the program being parsed."""

    num_replicas: int
    num_partitions: int

    @property
    def num_devices(self) -> int:
        return self.num_replicas * self.num_partitions


@dataclasses.dataclass(frozen=True)
class _OpContext:
    """A collective instruction with what is needed to interpret it."""

    instruction: _Instruction
    kind: str
    is_async: bool
    computation: str
    device_space: _DeviceSpace

    def error(self, message: str) -> ValueError:
        """Returns a ValueError that names the instruction."""
        return ValueError(
            f"HLO instruction %{self.instruction.name} ({self.instruction.opcode} "
            f"in computation {self.computation}): {message}"
        )


def parse_collectives(
    hlo_text: str,
    mesh_shape: tuple[int, ...] | Mapping[str, int],
    axis_names: tuple[str, ...],
) -> list[CollectiveOp]:
    """Lists every collective instruction of an optimized HLO module.

    Args:
        hlo_text: Text of a compiled module, e.g.
            `jax.jit(f).lower(*args).compile().as_text()`.
        mesh_shape: Shape of the device mesh the program was compiled for;
            device ids index its devices in row-major order. A mapping of
            axis name to size (such as `jax.sharding.Mesh.shape`) is
            accepted too, and its sizes are used in order.
        axis_names: Names of the mesh axes, one per entry of `mesh_shape`.

    Returns:
        One `CollectiveOp` per collective instruction, in the order the
        instructions are printed (async pairs counted once).

    Raises:
        ValueError: If the mesh does not match the module's device count,
            or an instruction has replica groups, operands or shapes that
            cannot be parsed exactly; the message names the instruction.

    Example:

    ```python
    text = jax.jit(f).lower(x, w).compile().as_text()
    for op in parse_collectives(text, (2, 4), ("batch", "model")):
        print(op.kind, op.mesh_axes, op.operand_bytes)
    ```
    """
    if isinstance(mesh_shape, Mapping):
        mesh_shape = tuple(mesh_shape.values())
    mesh_shape = tuple(int(size) for size in mesh_shape)
    axis_names = tuple(axis_names)
    if len(mesh_shape) != len(axis_names):
        raise ValueError(
            f"mesh_shape {mesh_shape} and axis_names {axis_names} must have "
            "the same length."
        )
    device_space = _device_space(hlo_text, math.prod(mesh_shape))
    ops = []
    for computation in _parse_computations(hlo_text):
        ops.extend(
            _computation_collectives(computation, device_space, mesh_shape, axis_names)
        )
    return ops


def summarize_collectives(ops: list[CollectiveOp]) -> list[dict]:
    """Groups collectives by kind and mesh axes and totals their bytes.

    Args:
        ops: Collectives, e.g. the result of `parse_collectives`.

    Returns:
        One dict per `(kind, mesh_axes)` pair with keys `"kind"`,
        `"mesh_axes"` (a list, or `None` when not derivable), `"count"`, and
        the per-device byte totals over the group, `"operand_bytes"` and
        `"result_bytes"`; sorted by kind then mesh axes (`None` last).

    Example:

    >>> op = CollectiveOp("all-reduce", "ar", "main", 512, 512,
    ...                   ("f32[8,16]",), ((0, 1),), ("model",))
    >>> summarize_collectives([op, op])[0]["operand_bytes"]
    1024
    """
    totals = collections.defaultdict(lambda: [0, 0, 0])
    for op in ops:
        total = totals[(op.kind, op.mesh_axes)]
        total[0] += 1
        total[1] += op.operand_bytes
        total[2] += op.result_bytes
    keys = sorted(totals, key=lambda key: (key[0], key[1] is None, key[1] or ()))
    return [
        {
            "kind": kind,
            "mesh_axes": None if mesh_axes is None else list(mesh_axes),
            "count": totals[(kind, mesh_axes)][0],
            "operand_bytes": totals[(kind, mesh_axes)][1],
            "result_bytes": totals[(kind, mesh_axes)][2],
        }
        for kind, mesh_axes in keys
    ]


# ---------------------------------------------------------------------------
# Module structure.
# ---------------------------------------------------------------------------


def _device_space(hlo_text: str, num_mesh_devices: int) -> _DeviceSpace:
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
    space = _DeviceSpace(num_replicas, num_partitions)
    if space.num_devices != num_mesh_devices:
        raise ValueError(
            f"The HLO module runs on {space.num_devices} devices "
            f"(replica_count={num_replicas}, num_partitions={num_partitions}) "
            f"but the mesh has {num_mesh_devices}."
        )
    return space


def _parse_computations(hlo_text: str) -> list[_Computation]:
    """Splits HLO text into computations of parsed instructions.

    Args:
        hlo_text: HLO module text.

    Returns:
        The computations in printed order.
    """
    computations = []
    name = None
    instructions = []
    for line in hlo_text.splitlines():
        if name is None:
            head = _COMPUTATION_HEAD.match(line)
            if head and not line.startswith("HloModule"):
                name, instructions = head.group("name"), []
        elif line.strip() == "}":
            computations.append(_Computation(name, tuple(instructions)))
            name = None
        else:
            instruction = _parse_instruction(line)
            if instruction is not None:
                instructions.append(instruction)
    return computations


def _parse_instruction(line: str) -> _Instruction | None:
    """Splits one instruction line into name, shape, opcode and the rest.

    Args:
        line: A line inside a computation body.

    Returns:
        The instruction, or `None` when the line is not an instruction.
    """
    line = _INDEX_COMMENT.sub("", line)
    head = _INSTRUCTION_HEAD.match(line)
    if head is None:
        return None
    shape_end = _shape_text_end(line, head.end())
    opcode = _OPCODE.match(line, shape_end) if shape_end else None
    if opcode is None:
        return None
    operands_end = _balanced_end(line, opcode.end() - 1)
    return _Instruction(
        name=head.group("name"),
        shape_text=line[head.end() : shape_end],
        opcode=opcode.group("opcode"),
        operands_text=line[opcode.end() : operands_end - 1],
        attributes=line[operands_end:].lstrip(", "),
    )


def _shape_text_end(text: str, start: int) -> int | None:
    """Returns the index just past a shape that starts at `start`, or None."""
    if text.startswith("(", start):
        return _balanced_end(text, start)
    array = _ARRAY_SHAPE.match(text, start)
    if array is None:
        return None
    if text.startswith("{", array.end()):
        return _balanced_end(text, array.end())
    return array.end()


def _balanced_end(text: str, start: int) -> int:
    """Returns the index just past the bracket that closes `text[start]`.

    Args:
        text: Text to scan; double-quoted strings are skipped.
        start: Index of an opening `(`, `[` or `{`.

    Returns:
        The index after the matching closing bracket.

    Raises:
        ValueError: If the brackets are not balanced.
    """
    depth = 0
    in_string = False
    index = start
    while index < len(text):
        char = text[index]
        if in_string:
            if char == "\\":
                index += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    raise ValueError(f"Unbalanced brackets in HLO text: {text[start : start + 80]!r}")


def _split_top_level(text: str) -> list[tuple[int, str]]:
    """Splits text at commas outside brackets and strings.

    Args:
        text: Comma-separated HLO text, e.g. operands or attributes.

    Returns:
        `(start_index, piece)` pairs; pieces keep surrounding whitespace.
    """
    pieces = []
    depth = 0
    in_string = False
    piece_start = 0
    for index, char in enumerate(text):
        if in_string:
            in_string = char != '"' or text[index - 1] == "\\"
        elif char == '"':
            in_string = True
        elif char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            depth -= 1
        elif char == "," and depth == 0:
            pieces.append((piece_start, text[piece_start:index]))
            piece_start = index + 1
    if text[piece_start:].strip():
        pieces.append((piece_start, text[piece_start:]))
    return pieces


def _attribute_start(attributes: str, key: str) -> int | None:
    """Returns the index where the value of a top-level attribute starts."""
    for start, piece in _split_top_level(attributes):
        stripped = piece.lstrip()
        if stripped.startswith(f"{key}="):
            return start + len(piece) - len(stripped) + len(key) + 1
    return None


# ---------------------------------------------------------------------------
# Shapes and bytes.
# ---------------------------------------------------------------------------


def _parse_shape(text: str) -> list[_ArrayShape]:
    """Parses an HLO shape (array or nested tuple) into its array leaves.

    Args:
        text: Shape text such as `"(f32[8,16]{1,0}, bf16[4])"`.

    Returns:
        The array shapes in tuple order (one entry for an array shape,
        none for an empty tuple).

    Raises:
        ValueError: For an unknown dtype or an unbounded dynamic dimension.
    """
    text = _INDEX_COMMENT.sub("", text).strip()
    if text.startswith("("):
        inner = text[1 : _balanced_end(text, 0) - 1]
        leaves = []
        for _, piece in _split_top_level(inner):
            leaves.extend(_parse_shape(piece))
        return leaves
    array = _ARRAY_SHAPE.match(text)
    if array is None:
        raise ValueError(f"Cannot parse HLO shape {text!r}.")
    return [_array_shape(array, text[array.end() :])]


def _array_shape(array: re.Match, layout: str) -> _ArrayShape:
    """Builds an `_ArrayShape` from a dtype[dims] match and its layout text."""
    dtype = array.group("dtype")
    if _dtype_bits(dtype) is None:
        raise ValueError(f"Unknown HLO element type {dtype!r}.")
    sizes = []
    for dim in filter(None, array.group("dims").split(",")):
        bound = dim.strip().removeprefix("<=")
        if not bound.isdigit():
            raise ValueError(f"Cannot size dimension {dim!r} of {array.group(0)!r}.")
        sizes.append(int(bound))
    packed = _LAYOUT_ELEMENT_BITS.search(layout) if layout.startswith("{") else None
    return _ArrayShape(
        dtype=dtype,
        dims_text=array.group("dims"),
        num_elements=math.prod(sizes),
        packed_bits=int(packed.group(1)) if packed else None,
    )


def _dtype_bits(dtype: str) -> int | None:
    """Returns the bit width of an HLO element type, or None if unknown."""
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    if re.fullmatch(r"f8e\d+m\d+\w*", dtype):
        return 8
    return None


def _shape_bytes(shapes: list[_ArrayShape]) -> int:
    """Returns the bytes of array shapes, as XLA lays them out in memory.

    Element types narrower than a byte take one byte each unless the layout
    packs them (`E(bits)`).
    """
    total = 0
    for shape in shapes:
        bits = _dtype_bits(shape.dtype)
        if shape.packed_bits is not None and bits:
            total += math.ceil(shape.num_elements * shape.packed_bits / 8)
        else:
            total += shape.num_elements * math.ceil(bits / 8)
    return total


# ---------------------------------------------------------------------------
# Collectives.
# ---------------------------------------------------------------------------


def _collective_kind(opcode: str) -> tuple[str, bool] | None:
    """Returns `(kind, is_async)` for a collective opcode, None otherwise.

    `-done` opcodes return None: the pair is reported by its `-start`.
    """
    if opcode in COLLECTIVE_KINDS:
        return opcode, False
    base = opcode.removesuffix("-start")
    if base != opcode and base in COLLECTIVE_KINDS:
        return base, True
    return None


def _computation_collectives(
    computation: _Computation,
    device_space: _DeviceSpace,
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
) -> list[CollectiveOp]:
    """Builds the `CollectiveOp`s of one computation.

    Args:
        computation: A parsed computation.
        device_space: Replica and partition counts of the module.
        mesh_shape: Mesh shape used to derive mesh axes.
        axis_names: Mesh axis names.

    Returns:
        The collectives of the computation in printed order.
    """
    shapes = {inst.name: inst.shape_text for inst in computation.instructions}
    done_shapes = _done_shapes(computation)
    ops = []
    for instruction in computation.instructions:
        kind_and_async = _collective_kind(instruction.opcode)
        if kind_and_async is None:
            continue
        kind, is_async = kind_and_async
        context = _OpContext(
            instruction, kind, is_async, computation.name, device_space
        )
        ops.append(_build_op(context, shapes, done_shapes, mesh_shape, axis_names))
    return ops


def _done_shapes(computation: _Computation) -> dict[str, str]:
    """Maps each async `-start` name to the shape of its `-done`."""
    done_shapes = {}
    for instruction in computation.instructions:
        if instruction.opcode.endswith(_PAIRED_SUFFIXES[1]):
            operands = _operand_names_and_shapes(instruction.operands_text)
            if operands:
                done_shapes[operands[0][0]] = instruction.shape_text
    return done_shapes


def _build_op(
    context: _OpContext,
    shapes: dict[str, str],
    done_shapes: dict[str, str],
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
) -> CollectiveOp:
    """Builds one `CollectiveOp` from a collective instruction.

    Args:
        context: The instruction and how to interpret it.
        shapes: Shape text of every instruction of the computation by name.
        done_shapes: Shape of the `-done` of each async start, by start name.
        mesh_shape: Mesh shape used to derive mesh axes.
        axis_names: Mesh axis names.

    Returns:
        The collective's record.
    """
    operand_shapes = _operand_shapes(context, shapes)
    result_shapes = _result_shapes(context, done_shapes)
    if context.kind == "collective-permute":
        pairs = _source_target_pairs(context)
        groups = _connected_components(pairs)
        mesh_axes = _mesh_axes_for_pairs(pairs, mesh_shape, axis_names)
    else:
        pairs = ()
        groups = _replica_groups(context)
        mesh_axes = _mesh_axes_for_groups(groups, mesh_shape, axis_names)
    return CollectiveOp(
        kind=context.kind,
        name=context.instruction.name,
        computation=context.computation,
        operand_bytes=_shape_bytes(operand_shapes),
        result_bytes=_shape_bytes(result_shapes),
        operand_shapes=tuple(shape.text for shape in operand_shapes),
        replica_groups=groups,
        mesh_axes=mesh_axes,
        result_shapes=tuple(shape.text for shape in result_shapes),
        source_target_pairs=pairs,
        is_async=context.is_async,
    )


def _operand_names_and_shapes(operands_text: str) -> list[tuple[str, str]]:
    """Splits an operand list into `(name, inline_shape_text)` pairs.

    Args:
        operands_text: Text between the opcode's parentheses, e.g.
            `"f32[8]{0} %a, %b"`.

    Returns:
        One pair per operand; the shape text is empty when not printed.
    """
    operands = []
    for _, piece in _split_top_level(operands_text):
        parts = piece.strip().rsplit(maxsplit=1)
        name = parts[-1].removeprefix("%")
        operands.append((name, parts[0] if len(parts) == 2 else ""))
    return operands


def _operand_shapes(context: _OpContext, shapes: dict[str, str]) -> list[_ArrayShape]:
    """Resolves the array shapes of a collective's operands.

    Inline operand shapes are used when printed; otherwise the shape comes
    from the instruction that defines the operand in the same computation.
    """
    operands = _operand_names_and_shapes(context.instruction.operands_text)
    if not operands:
        raise context.error("it has no operands.")
    resolved = []
    for name, inline_shape in operands:
        shape_text = inline_shape or shapes.get(name)
        if not shape_text:
            raise context.error(f"cannot resolve the shape of operand %{name}.")
        resolved.extend(_parse_shape(shape_text))
    return resolved


def _result_shapes(
    context: _OpContext, done_shapes: dict[str, str]
) -> list[_ArrayShape]:
    """Returns the array shapes of a collective's result.

    For an async start, the result is the `-done` shape when the `-done` is
    found. Otherwise an `all-reduce-start` is shaped like its result, and
    the other starts hold `(operands, result, ...)` tuples: the second
    element is the result.
    """
    instruction = context.instruction
    if not context.is_async:
        return _parse_shape(instruction.shape_text)
    if instruction.name in done_shapes:
        return _parse_shape(done_shapes[instruction.name])
    shape_text = _INDEX_COMMENT.sub("", instruction.shape_text).strip()
    if context.kind == "all-reduce" or not shape_text.startswith("("):
        return _parse_shape(shape_text)
    elements = _split_top_level(shape_text[1:-1])
    if len(elements) < 2:
        raise context.error(f"cannot find the result in shape {shape_text!r}.")
    return _parse_shape(elements[1][1])


# ---------------------------------------------------------------------------
# Replica groups.
# ---------------------------------------------------------------------------


def _replica_groups(context: _OpContext) -> tuple[tuple[int, ...], ...]:
    """Returns the communicating groups as explicit global device ids.

    Args:
        context: A collective instruction with replica groups.

    Returns:
        The groups, in the order XLA prints them, after translating replica
        or partition ids to global device ids according to the collective's
        group mode (see `_group_mode`).
    """
    attributes = context.instruction.attributes
    start = _attribute_start(attributes, "replica_groups")
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


def _group_mode(context: _OpContext) -> str:
    """Returns how XLA interprets the ids in a collective's replica groups.

    Returns:
        `"flattened"` (global device ids), `"cross_partition"` (partition ids,
        repeated per replica), `"cross_replica"` (replica ids, repeated per
        partition) or `"cross_replica_and_partition"` (replica ids, each
        covering all partitions).
    """
    attributes = context.instruction.attributes
    has_channel = _attribute_start(attributes, "channel_id") is not None
    if context.kind not in _GLOBAL_ID_KINDS:
        return "cross_partition" if has_channel else "cross_replica"
    if not has_channel:
        return "cross_replica"
    start = _attribute_start(attributes, "use_global_device_ids")
    if start is not None and attributes.startswith("true", start):
        return "flattened"
    return "cross_replica_and_partition"


def _id_limit(mode: str, space: _DeviceSpace) -> int:
    """Returns how many distinct ids the replica groups of a mode can use."""
    if mode == "flattened":
        return space.num_devices
    if mode == "cross_partition":
        return space.num_partitions
    return space.num_replicas


def _to_device_groups(
    groups: list[list[int]], mode: str, space: _DeviceSpace
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
    attributes: str, start: int, context: _OpContext
) -> list[list[int]]:
    """Parses a `replica_groups=` value in any form XLA prints.

    Args:
        attributes: Attribute text of the instruction.
        start: Index where the value starts.
        context: The instruction, for error messages.

    Returns:
        The groups as lists of ids; an empty list for `{}` (all ids).

    Raises:
        ValueError: For a form this parser does not know.
    """
    value = attributes[start:]
    if value.startswith("{"):
        return _parse_explicit_groups(value[: _balanced_end(value, 0)], context)
    iota = _IOTA_GROUPS.match(value)
    if iota:
        return _iota_groups(iota, context)
    if value.startswith("mesh["):
        return _mesh_groups(value, context)
    raise context.error(f"unsupported replica_groups form {value[:60]!r}.")


def _parse_explicit_groups(text: str, context: _OpContext) -> list[list[int]]:
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


def _iota_groups(iota: re.Match, context: _OpContext) -> list[list[int]]:
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
    reshape_dims: tuple[int, ...], perm: tuple[int, ...], context: _OpContext
) -> np.ndarray:
    """Returns `arange(prod(dims)).reshape(dims).transpose(perm)`."""
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    if not perm:
        return ids
    if sorted(perm) != list(range(len(reshape_dims))):
        raise context.error(f"bad iota transpose {perm} for dims {reshape_dims}.")
    return ids.transpose(perm)


def _mesh_groups(value: str, context: _OpContext) -> list[list[int]]:
    """Expands the mesh-axes form `mesh['a'=2,'b'=4] {'a'}` into groups.

    The optional `, device_ids=(...)` gives the mesh's device order (an iota
    such as `[2,2,2]T(0,2,1)` or an explicit id list). Grouped axes may be
    sub-axes `'a':(pre_size)size`. Devices are grouped by reshaping the mesh
    to split sub-axes, moving the grouped dimensions last and reading
    consecutive runs of the group size, as XLA does.
    """
    mesh_end = _balanced_end(value, len("mesh"))
    names, sizes = _mesh_axes_spec(value[len("mesh") + 1 : mesh_end - 1], context)
    rest = value[mesh_end:]
    device_ids = np.arange(math.prod(sizes))
    ids_match = re.match(r"\s*,\s*device_ids=\(", rest)
    if ids_match:
        ids_end = _balanced_end(rest, ids_match.end() - 1)
        device_ids = _mesh_device_ids(
            rest[ids_match.end() : ids_end - 1], sizes, context
        )
        rest = rest[ids_end:]
    axes_match = re.match(r"\s*\{", rest)
    if axes_match is None:
        raise context.error(f"cannot parse mesh replica groups {value[:80]!r}.")
    axes_end = _balanced_end(rest, axes_match.end() - 1)
    axis_refs = _group_axis_refs(rest[axes_match.end() : axes_end - 1], names, context)
    return _groups_over_mesh_axes(device_ids, sizes, axis_refs, context)


def _mesh_axes_spec(
    text: str, context: _OpContext
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Parses `'a'=2,'b'=4` into axis names and sizes."""
    names, sizes = [], []
    for _, piece in _split_top_level(text):
        axis = _MESH_AXIS.match(piece.strip())
        if axis is None:
            raise context.error(f"cannot parse mesh axis {piece.strip()!r}.")
        names.append(axis.group("name"))
        sizes.append(int(axis.group("size")))
    if not names:
        raise context.error("the replica-group mesh has no axes.")
    return tuple(names), tuple(sizes)


def _mesh_device_ids(
    text: str, sizes: tuple[int, ...], context: _OpContext
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
    text: str, names: tuple[str, ...], context: _OpContext
) -> list[tuple[int, tuple[int, int] | None]]:
    """Parses `'a','b':(2)2` into `(axis_index, (pre_size, size) or None)`."""
    refs = []
    for _, piece in _split_top_level(text):
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
    context: _OpContext,
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
    axis_size: int, sub_axes: list[tuple[int, int] | None], context: _OpContext
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


def _source_target_pairs(context: _OpContext) -> tuple[tuple[int, int], ...]:
    """Returns a collective-permute's pairs as global device ids."""
    attributes = context.instruction.attributes
    start = _attribute_start(attributes, "source_target_pairs")
    if start is None or not attributes.startswith("{", start):
        raise context.error("it has no source_target_pairs.")
    text = attributes[start : _balanced_end(attributes, start)]
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


def _connected_components(
    pairs: tuple[tuple[int, int], ...],
) -> tuple[tuple[int, ...], ...]:
    """Returns the sorted connected components of a permute's pairs."""
    parent = {}

    def root(device: int) -> int:
        parent.setdefault(device, device)
        while parent[device] != device:
            parent[device] = parent[parent[device]]
            device = parent[device]
        return device

    for source, target in pairs:
        parent[root(source)] = root(target)
    components = collections.defaultdict(list)
    for device in sorted(parent):
        components[root(device)].append(device)
    return tuple(sorted(tuple(group) for group in components.values()))


# ---------------------------------------------------------------------------
# Mesh axes.
# ---------------------------------------------------------------------------


def _mesh_coordinates(mesh_shape: tuple[int, ...]) -> np.ndarray:
    """Returns the row-major mesh coordinates of each device id."""
    return np.stack(np.unravel_index(np.arange(math.prod(mesh_shape)), mesh_shape), 1)


def _mesh_axes_for_groups(
    groups: tuple[tuple[int, ...], ...],
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
) -> tuple[str, ...] | None:
    """Returns the mesh axes whose device classes are exactly `groups`.

    Args:
        groups: Groups of device ids.
        mesh_shape: Mesh shape; ids index its devices in row-major order.
        axis_names: Mesh axis names.

    Returns:
        The axes (in mesh order) such that every group is the set of devices
        sharing all coordinates outside them, or None when no subset of axes
        produces these groups.
    """
    num_devices = math.prod(mesh_shape)
    members = sorted(device for group in groups for device in group)
    if members != list(range(num_devices)):
        return None
    coordinates = _mesh_coordinates(mesh_shape)
    varying = set()
    for group in groups:
        group_coordinates = coordinates[list(group)]
        varying.update(np.flatnonzero(np.ptp(group_coordinates, axis=0) > 0).tolist())
    fixed = [dim for dim in range(len(mesh_shape)) if dim not in varying]
    expected = collections.defaultdict(set)
    for device in range(num_devices):
        expected[tuple(coordinates[device, fixed])].add(device)
    if {frozenset(group) for group in groups} != {
        frozenset(group) for group in expected.values()
    }:
        return None
    return tuple(axis_names[dim] for dim in sorted(varying))


def _mesh_axes_for_pairs(
    pairs: tuple[tuple[int, int], ...],
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
) -> tuple[str, ...] | None:
    """Returns the mesh axes along which a permute's pairs move data.

    Args:
        pairs: `(source, target)` device ids.
        mesh_shape: Mesh shape; ids index its devices in row-major order.
        axis_names: Mesh axis names.

    Returns:
        The axes (in mesh order) where some source and target coordinates
        differ, or None when an id is outside the mesh.
    """
    num_devices = math.prod(mesh_shape)
    if any(device >= num_devices for pair in pairs for device in pair):
        return None
    coordinates = _mesh_coordinates(mesh_shape)
    varying = set()
    for source, target in pairs:
        differs = coordinates[source] != coordinates[target]
        varying.update(np.flatnonzero(differs).tolist())
    return tuple(axis_names[dim] for dim in sorted(varying))
