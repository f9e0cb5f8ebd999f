"""All-reduces whose result each device keeps only its part of: reduce-scatters
in all but name.

The SPMD partitioner writes a reduce-scatter as an all-reduce followed by a
dynamic slice at the device's partition id; XLA:GPU's `ReduceScatterCreator`
then fuses the pair into a `reduce-scatter`, XLA:CPU (jax 0.10.2) has no such
pass and keeps the pair, the slice usually fused into the consumer (measured
on sequence-parallel KerasHub GPT-2 on 1x4: `fusion(%all-reduce.9,
%partition-id.19, ...)` producing a quarter of its shape). Counting such an
all-reduce as one would double its bytes on the wire against the program an
accelerator runs; `scattered_operand_bytes` finds them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from keras_autoshard.report.hlo.text import (
    Instruction,
    operand_names_and_shapes,
    parse_shape,
    shape_bytes,
)

_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")


def users_by_operand(
    instructions: Sequence[Instruction],
) -> dict[str, list[Instruction]]:
    """Instruction name → the instructions of the computation that read it.

    Args:
        instructions: One computation's instructions.

    Returns:
        The readers of each instruction, in printed order.
    """
    users: dict[str, list[Instruction]] = {}
    for instruction in instructions:
        for name in _names(instruction.operands_text):
            users.setdefault(name, []).append(instruction)
    return users


def scattered_operand_bytes(
    all_reduce: Instruction,
    users: Mapping[str, list[Instruction]],
    group_size: int,
) -> int:
    """Bytes of `all_reduce`'s operands whose reduced value every reader
    slices to this device's `1/group_size` part.

    A reader slices when it is a `dynamic-slice`, or reads `partition-id`
    (the slice's offset) and makes `1/group_size` of the elements.

    Args:
        all_reduce: An `all-reduce` instruction.
        users: The computation's `users_by_operand`.
        group_size: Devices in each replica group.

    Returns:
        The bytes (0 when nothing is sliced, or `group_size` is 1).
    """
    if group_size <= 1:
        return 0
    elements = parse_shape(all_reduce.shape_text)
    if all_reduce.shape_text.lstrip().startswith("("):
        values = {
            int(match.group(1)): user.name
            for user in users.get(all_reduce.name, ())
            if user.opcode == "get-tuple-element"
            and (match := _TUPLE_INDEX.search(user.attributes))
        }
    else:
        values = {0: all_reduce.name}
    scattered = 0
    for index, element in enumerate(elements):
        name = values.get(index)
        readers = users.get(name, []) if name else []
        if readers and all(
            _keeps_own_part(reader, element.num_elements, group_size)
            for reader in readers
        ):
            scattered += shape_bytes([element])
    return scattered


def _keeps_own_part(reader: Instruction, num_elements: int, group_size: int) -> bool:
    shapes = parse_shape(reader.shape_text)
    if len(shapes) != 1 or shapes[0].num_elements * group_size != num_elements:
        return False
    return reader.opcode == "dynamic-slice" or any(
        name.startswith("partition-id") for name in _names(reader.operands_text)
    )


def _names(operands_text: str) -> list[str]:
    return [name for name, _ in operand_names_and_shapes(operands_text)]
