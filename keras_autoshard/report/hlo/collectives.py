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

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping

from keras_autoshard.errors import HloParseError
from keras_autoshard.report.hlo.mesh_axes import (
    connected_components,
    mesh_axes_for_groups,
    mesh_axes_for_pairs,
)
from keras_autoshard.report.hlo.replica_groups import (
    DeviceSpace,
    OpContext,
    read_device_space,
    read_replica_groups,
    source_target_pairs,
)
from keras_autoshard.report.hlo.scatter import (
    scattered_operand_bytes,
    users_by_operand,
)
from keras_autoshard.report.hlo.text import (
    INDEX_COMMENT,
    ArrayShape,
    Computation,
    operand_names_and_shapes,
    parse_computations,
    parse_shape,
    shape_bytes,
    split_top_level,
)

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
        scattered_bytes: Of an all-reduce's `operand_bytes`, those whose
            result every reader slices to this device's part: a
            reduce-scatter as XLA:CPU writes it (`hlo/scatter.py`).

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
    scattered_bytes: int = 0

    @property
    def group_size(self) -> int:
        """Devices in each replica group (1 when there are none)."""
        return max((len(group) for group in self.replica_groups), default=1)

    @property
    def ring_bytes(self) -> float:
        """Bytes one device sends for this op under ring algorithms, the
        measure of NCCL's bus bandwidth: an all-reduce of N bytes over g
        devices sends 2(g-1)/g N, a reduce-scatter (an all-reduce whose
        result is sliced, `scattered_bytes`) and an all-to-all (g-1)/g N,
        an all-gather (g-1) times its shard, a permute its operand.

        Example:

        >>> op = CollectiveOp("all-gather", "ag", "main", 4, 16, ("f32[1]",),
        ...                   ((0, 1, 2, 3),), ("model",))
        >>> op.ring_bytes
        12.0
        """
        g = self.group_size
        if self.kind == "all-reduce":
            whole = self.operand_bytes - self.scattered_bytes
            return (g - 1) / g * (2 * whole + self.scattered_bytes)
        if self.kind == "all-gather":
            return float((g - 1) * self.operand_bytes)
        if self.kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
            return (g - 1) / g * self.operand_bytes
        return float(self.operand_bytes)

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
            "scattered_bytes": self.scattered_bytes,
        }


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
        HloParseError: If the mesh does not match the module's device count,
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
        raise HloParseError(
            f"mesh_shape {mesh_shape} and axis_names {axis_names} must have "
            "the same length."
        )
    device_space = read_device_space(hlo_text, math.prod(mesh_shape))
    ops = []
    for computation in parse_computations(hlo_text):
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
        the per-device byte totals over the group, `"operand_bytes"`,
        `"result_bytes"` and `"ring_bytes"` (`CollectiveOp.ring_bytes`);
        sorted by kind then mesh axes (`None` last).

    Example:

    >>> op = CollectiveOp("all-reduce", "ar", "main", 512, 512,
    ...                   ("f32[8,16]",), ((0, 1),), ("model",))
    >>> summarize_collectives([op, op])[0]["operand_bytes"]
    1024
    """
    totals = collections.defaultdict(lambda: [0, 0, 0, 0.0])
    for op in ops:
        total = totals[(op.kind, op.mesh_axes)]
        total[0] += 1
        total[1] += op.operand_bytes
        total[2] += op.result_bytes
        total[3] += op.ring_bytes
    keys = sorted(totals, key=lambda key: (key[0], key[1] is None, key[1] or ()))
    return [
        {
            "kind": kind,
            "mesh_axes": None if mesh_axes is None else list(mesh_axes),
            "count": totals[(kind, mesh_axes)][0],
            "operand_bytes": totals[(kind, mesh_axes)][1],
            "result_bytes": totals[(kind, mesh_axes)][2],
            "ring_bytes": totals[(kind, mesh_axes)][3],
        }
        for kind, mesh_axes in keys
    ]


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
    computation: Computation,
    device_space: DeviceSpace,
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
    users = users_by_operand(computation.instructions)
    ops = []
    for instruction in computation.instructions:
        kind_and_async = _collective_kind(instruction.opcode)
        if kind_and_async is None:
            continue
        kind, is_async = kind_and_async
        context = OpContext(instruction, kind, is_async, computation.name, device_space)
        op = _build_op(context, shapes, done_shapes, mesh_shape, axis_names)
        if kind == "all-reduce" and not is_async:
            scattered = scattered_operand_bytes(instruction, users, op.group_size)
            op = dataclasses.replace(op, scattered_bytes=scattered)
        ops.append(op)
    return ops


def _done_shapes(computation: Computation) -> dict[str, str]:
    """Maps each async `-start` name to the shape of its `-done`."""
    done_shapes = {}
    for instruction in computation.instructions:
        if instruction.opcode.endswith(_PAIRED_SUFFIXES[1]):
            operands = operand_names_and_shapes(instruction.operands_text)
            if operands:
                done_shapes[operands[0][0]] = instruction.shape_text
    return done_shapes


def _build_op(
    context: OpContext,
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
        pairs = source_target_pairs(context)
        groups = connected_components(pairs)
        mesh_axes = mesh_axes_for_pairs(pairs, mesh_shape, axis_names)
    else:
        pairs = ()
        groups = read_replica_groups(context)
        mesh_axes = mesh_axes_for_groups(groups, mesh_shape, axis_names)
    return CollectiveOp(
        kind=context.kind,
        name=context.instruction.name,
        computation=context.computation,
        operand_bytes=shape_bytes(operand_shapes),
        result_bytes=shape_bytes(result_shapes),
        operand_shapes=tuple(shape.text for shape in operand_shapes),
        replica_groups=groups,
        mesh_axes=mesh_axes,
        result_shapes=tuple(shape.text for shape in result_shapes),
        source_target_pairs=pairs,
        is_async=context.is_async,
    )


def _operand_shapes(context: OpContext, shapes: dict[str, str]) -> list[ArrayShape]:
    """Resolves the array shapes of a collective's operands.

    Inline operand shapes are used when printed; otherwise the shape comes
    from the instruction that defines the operand in the same computation.
    """
    operands = operand_names_and_shapes(context.instruction.operands_text)
    if not operands:
        raise context.error("it has no operands.")
    resolved = []
    for name, inline_shape in operands:
        shape_text = inline_shape or shapes.get(name)
        if not shape_text:
            raise context.error(f"cannot resolve the shape of operand %{name}.")
        resolved.extend(parse_shape(shape_text))
    return resolved


def _result_shapes(context: OpContext, done_shapes: dict[str, str]) -> list[ArrayShape]:
    """Returns the array shapes of a collective's result.

    For an async start, the result is the `-done` shape when the `-done` is
    found. Otherwise an `all-reduce-start` is shaped like its result, and
    the other starts hold `(operands, result, ...)` tuples: the second
    element is the result.
    """
    instruction = context.instruction
    if not context.is_async:
        return parse_shape(instruction.shape_text)
    if instruction.name in done_shapes:
        return parse_shape(done_shapes[instruction.name])
    shape_text = INDEX_COMMENT.sub("", instruction.shape_text).strip()
    if context.kind == "all-reduce" or not shape_text.startswith("("):
        return parse_shape(shape_text)
    elements = split_top_level(shape_text[1:-1])
    if len(elements) < 2:
        raise context.error(f"cannot find the result in shape {shape_text!r}.")
    return parse_shape(elements[1][1])
