"""Peak memory of a compiled program's entry computation under the other
schedules XLA's memory schedulers choose from.

XLA:CPU scheduled for memory (`MEMORY_SCHEDULE_ON_CPU`) orders a program
depth-first from its outputs only (`DFSMemoryScheduler`), while XLA:GPU's
`DefaultMemoryScheduler` keeps the least peak of a list schedule, a
depth-first one and the computation's post order. A depth-first walk places
an instruction when it reaches a consumer of it: a parameter gradient that
no earlier layer's backward pass needs (a bias reduction, a kernel's weight
gradient) is placed at its optimizer update, and its operands stay live
until then. This module replays the same instructions, buffers and fusions
in the compiled order and in the two other orders, summing the bytes live
at each point (no fragmentation, no buffer shared between an operand and
its user), so that a reading on CPU can say what the accelerators' choice
would hold for the same program.

Pure Python: it reads the optimized HLO text (`compiled.as_text()`).
"""

from __future__ import annotations

import collections
import dataclasses
import re

from keras_autoshard.errors import HloParseError
from keras_autoshard.report.hlo.text import (
    Instruction,
    balanced_end,
    operand_names_and_shapes,
    parse_computations,
    parse_shape,
    shape_bytes,
    split_top_level,
)

# Instructions that name a buffer another instruction defined.
_ALIASING = frozenset({"bitcast", "get-tuple-element", "tuple"})

# `{output index}: (parameter number, {parameter index}, may-alias)`.
_ALIAS_ENTRY = re.compile(
    r"\{\s*(\d+)[^}]*\}\s*:\s*\(\s*\d+\s*,\s*\{[^}]*\}\s*,\s*(?:may|must)-alias\s*\)"
)

_TUPLE_INDEX = re.compile(r"(?:^|,)\s*index=(\d+)")

# (instruction name, array leaf index)
Buffer = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class SchedulePeaks:
    """Bytes live at the peak of one program under three schedules.

    Args:
        compiled_order: The order XLA compiled, replayed.
        list_order: A list schedule (XLA's `ListScheduler` rule: the ready
            instruction that frees the most bytes net of those it defines
            first, then the one with more users).
        post_order: The entry computation's post order (operands
            depth-first, in operand order, from the root).
        instructions: Instructions in the entry computation.
    """

    compiled_order: int
    list_order: int
    post_order: int
    instructions: int

    @property
    def least(self) -> int:
        """The peak XLA:GPU's `DefaultMemoryScheduler` would keep."""
        return min(self.compiled_order, self.list_order, self.post_order)


def schedule_peaks(hlo_text: str) -> SchedulePeaks:
    """Replays a scheduled module's entry computation in three orders.

    Args:
        hlo_text: Optimized HLO of a compiled program (`compiled.as_text()`),
            printed in schedule order (`is_scheduled=true`).

    Returns:
        A `SchedulePeaks` with the bytes live at each order's peak.

    Raises:
        HloParseError: When the text has no entry computation.

    Example:

    ```python
    compiled = jax.jit(step).lower(*args).compile(MEMORY_SCHEDULE_ON_CPU)
    peaks = schedule_peaks(compiled.as_text())
    peaks.compiled_order, peaks.least
    ```
    """
    program = _Program.parse(hlo_text)
    return SchedulePeaks(
        compiled_order=program.peak(program.order),
        list_order=program.peak(program.list_schedule()),
        post_order=program.peak(program.post_order()),
        instructions=len(program.order),
    )


class _Program:
    """The entry computation as buffers, their definers and their readers."""

    def __init__(self, instructions: tuple[Instruction, ...], in_place: set[int]):
        self.order = [inst.name for inst in instructions]
        self.by_name = {inst.name: inst for inst in instructions}
        self.operands = {
            inst.name: [
                name
                for name, _ in operand_names_and_shapes(inst.operands_text)
                if name in self.by_name
            ]
            for inst in instructions
        }
        self.leaves = {
            inst.name: [shape_bytes([leaf]) for leaf in parse_shape(inst.shape_text)]
            for inst in instructions
        }
        self._memo: dict[tuple[str, int | None], frozenset[Buffer]] = {}
        self.reads = {
            name: frozenset().union(*(self._buffers(o) for o in self.operands[name]))
            for name in self.order
        }
        self.root = next(
            (i.name for i in instructions if i.is_root), instructions[-1].name
        )
        self.outputs = self._buffers(self.root)
        # Parameters are allocated for the whole program; an output aliased
        # to a donated parameter is written into that parameter's buffer.
        self.parameters = {
            (inst.name, leaf)
            for inst in instructions
            if inst.opcode == "parameter"
            for leaf in range(len(self.leaves[inst.name]))
        }
        root_is_tuple = self.by_name[self.root].shape_text.lstrip().startswith("(")
        self.in_place = (
            frozenset().union(
                *(
                    self._buffers(self.root, element if root_is_tuple else None)
                    for element in in_place
                )
            )
            - self.parameters
        )
        self.users: dict[str, set[str]] = collections.defaultdict(set)
        for name in self.order:
            for operand in self.operands[name]:
                self.users[operand].add(name)

    @classmethod
    def parse(cls, hlo_text: str) -> _Program:
        entry = [c for c in parse_computations(hlo_text) if c.is_entry]
        if not entry:
            raise HloParseError("The HLO text has no ENTRY computation.")
        return cls(entry[0].instructions, _outputs_written_in_place(hlo_text))

    def _buffers(self, name: str, element: int | None = None) -> frozenset[Buffer]:
        """The buffers a value names (through bitcasts and tuples)."""
        key = (name, element)
        if key not in self._memo:
            inst = self.by_name[name]
            operands = self.operands[name]
            if inst.opcode == "get-tuple-element":
                index = _TUPLE_INDEX.search(inst.attributes)
                found = self._buffers(operands[0], int(index.group(1)))
            elif inst.opcode == "tuple":
                chosen = operands if element is None else [operands[element]]
                found = frozenset().union(*(self._buffers(o) for o in chosen))
            elif inst.opcode == "bitcast":
                found = self._buffers(operands[0], element)
            else:
                leaves = range(len(self.leaves[name]))
                if element is not None:
                    leaves = range(*_element_leaves(inst.shape_text)[element])
                found = frozenset((name, leaf) for leaf in leaves)
            self._memo[key] = found
        return self._memo[key]

    def _defined(self, name: str) -> list[Buffer]:
        if self.by_name[name].opcode in _ALIASING:
            return []
        return [(name, leaf) for leaf in range(len(self.leaves[name]))]

    def _size(self, buffer: Buffer) -> int:
        if buffer in self.in_place:
            return 0
        return self.leaves[buffer[0]][buffer[1]]

    def peak(self, sequence: list[str]) -> int:
        """Bytes live at the fullest point of `sequence`."""
        position = {name: index for index, name in enumerate(sequence)}
        last_read: dict[Buffer, int] = {}
        for name in sequence:
            for buffer in self.reads[name]:
                last_read[buffer] = max(last_read.get(buffer, 0), position[name])
        end_of_program = len(sequence)
        delta = [0] * (end_of_program + 2)
        for name in sequence:
            for buffer in self._defined(name):
                start = 0 if buffer in self.parameters else position[name]
                if buffer in self.parameters or buffer in self.outputs:
                    end = end_of_program
                else:
                    end = last_read.get(buffer, start)
                delta[start] += self._size(buffer)
                delta[end + 1] -= self._size(buffer)
        live = peak = 0
        for change in delta:
            live += change
            peak = max(peak, live)
        return peak

    def list_schedule(self) -> list[str]:
        """Greedy: of the ready instructions, the one freeing the most bytes
        net of those it defines, then the most users, then compiled order."""
        compiled_position = {name: index for index, name in enumerate(self.order)}
        readers_left = collections.Counter()
        for name in self.order:
            for buffer in self.reads[name]:
                readers_left[buffer] += 1
        waiting = {name: len(set(self.operands[name])) for name in self.order}
        ready = [name for name in self.order if waiting[name] == 0]
        held = self.parameters | self.outputs
        sequence = []

        def priority(name: str) -> tuple[int, int, int]:
            freed = sum(
                self._size(b)
                for b in self.reads[name]
                if readers_left[b] == 1 and b not in held
            )
            defined = sum(self._size(b) for b in self._defined(name))
            return (defined - freed, -len(self.users[name]), compiled_position[name])

        while ready:
            name = min(ready, key=priority)
            ready.remove(name)
            sequence.append(name)
            for buffer in self.reads[name]:
                readers_left[buffer] -= 1
            for user in self.users[name]:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)
        return sequence

    def post_order(self) -> list[str]:
        """Operands depth-first in operand order from the root, then the
        instructions the root does not reach."""
        sequence: list[str] = []
        seen: set[str] = set()
        for start in [self.root, *self.order]:
            if start in seen:
                continue
            seen.add(start)
            stack = [(start, 0)]
            while stack:
                name, next_operand = stack.pop()
                operands = self.operands[name]
                if next_operand < len(operands):
                    stack.append((name, next_operand + 1))
                    operand = operands[next_operand]
                    if operand not in seen:
                        seen.add(operand)
                        stack.append((operand, 0))
                else:
                    sequence.append(name)
        return sequence


def _outputs_written_in_place(hlo_text: str) -> set[int]:
    """Output elements the module header aliases to donated parameters."""
    header = hlo_text.lstrip().split("\n", 1)[0]
    start = header.find("input_output_alias={")
    if start < 0:
        return set()
    brace = start + len("input_output_alias=")
    aliases = header[brace : balanced_end(header, brace)]
    return {int(output) for output in _ALIAS_ENTRY.findall(aliases)}


def _element_leaves(shape_text: str) -> list[tuple[int, int]]:
    """`[start, stop)` leaf ranges of each top-level element of a tuple."""
    text = shape_text.strip()
    if not text.startswith("("):
        return [(0, len(parse_shape(text)))]
    ranges, start = [], 0
    for _, piece in split_top_level(text[1 : balanced_end(text, 0) - 1]):
        count = len(parse_shape(piece))
        ranges.append((start, start + count))
        start += count
    return ranges
