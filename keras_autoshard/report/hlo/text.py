"""Reading optimized HLO text: computations, instructions, operand names,
shapes and their byte sizes, balanced brackets and attributes.

Pure Python (stdlib and numpy): it never imports JAX."""

from __future__ import annotations

import dataclasses
import math
import re

from keras_autoshard.errors import HloParseError

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


INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")


_INSTRUCTION_HEAD = re.compile(r"^\s+(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*")


_COMPUTATION_HEAD = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*(?:\(.*)?\{\s*$")


_ARRAY_SHAPE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")


_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][a-z0-9\-]*)\(")


_LAYOUT_ELEMENT_BITS = re.compile(r"E\((\d+)\)")


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    """A dense array shape: dtype, dimension sizes and packed element bits."""

    dtype: str
    dims_text: str
    num_elements: int
    packed_bits: int | None

    @property
    def text(self) -> str:
        return f"{self.dtype}[{self.dims_text}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """The parts of one HLO instruction line this module needs."""

    name: str
    shape_text: str
    opcode: str
    operands_text: str
    attributes: str
    is_root: bool = False


@dataclasses.dataclass(frozen=True)
class Computation:
    """An HLO computation: its name, instructions in printed order (a
    scheduled module prints them in schedule order) and whether it is the
    module's entry."""

    name: str
    instructions: tuple[Instruction, ...]
    is_entry: bool = False


def parse_computations(hlo_text: str) -> list[Computation]:
    """Splits HLO text into computations of parsed instructions.

    Args:
        hlo_text: HLO module text.

    Returns:
        The computations in printed order.
    """
    computations = []
    name = None
    instructions = []
    is_entry = False
    for line in hlo_text.splitlines():
        if name is None:
            head = _COMPUTATION_HEAD.match(line)
            if head and not line.startswith("HloModule"):
                name, instructions = head.group("name"), []
                is_entry = line.startswith("ENTRY")
        elif line.strip() == "}":
            computations.append(Computation(name, tuple(instructions), is_entry))
            name = None
        else:
            instruction = _parse_instruction(line)
            if instruction is not None:
                instructions.append(instruction)
    return computations


def _parse_instruction(line: str) -> Instruction | None:
    """Splits one instruction line into name, shape, opcode and the rest.

    Args:
        line: A line inside a computation body.

    Returns:
        The instruction, or `None` when the line is not an instruction.
    """
    line = INDEX_COMMENT.sub("", line)
    head = _INSTRUCTION_HEAD.match(line)
    if head is None:
        return None
    shape_end = _shape_text_end(line, head.end())
    opcode = _OPCODE.match(line, shape_end) if shape_end else None
    if opcode is None:
        return None
    operands_end = balanced_end(line, opcode.end() - 1)
    return Instruction(
        name=head.group("name"),
        shape_text=line[head.end() : shape_end],
        opcode=opcode.group("opcode"),
        operands_text=line[opcode.end() : operands_end - 1],
        attributes=line[operands_end:].lstrip(", "),
        is_root=line.lstrip().startswith("ROOT "),
    )


def _shape_text_end(text: str, start: int) -> int | None:
    """Returns the index just past a shape that starts at `start`, or None."""
    if text.startswith("(", start):
        return balanced_end(text, start)
    array = _ARRAY_SHAPE.match(text, start)
    if array is None:
        return None
    if text.startswith("{", array.end()):
        return balanced_end(text, array.end())
    return array.end()


def balanced_end(text: str, start: int) -> int:
    """Returns the index just past the bracket that closes `text[start]`.

    Args:
        text: Text to scan; double-quoted strings are skipped.
        start: Index of an opening `(`, `[` or `{`.

    Returns:
        The index after the matching closing bracket.

    Raises:
        HloParseError: If the brackets are not balanced.
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
    raise HloParseError(
        f"Unbalanced brackets in HLO text: {text[start : start + 80]!r}"
    )


def split_top_level(text: str) -> list[tuple[int, str]]:
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


def attribute_start(attributes: str, key: str) -> int | None:
    """Returns the index where the value of a top-level attribute starts."""
    for start, piece in split_top_level(attributes):
        stripped = piece.lstrip()
        if stripped.startswith(f"{key}="):
            return start + len(piece) - len(stripped) + len(key) + 1
    return None


def parse_shape(text: str) -> list[ArrayShape]:
    """Parses an HLO shape (array or nested tuple) into its array leaves.

    Args:
        text: Shape text such as `"(f32[8,16]{1,0}, bf16[4])"`.

    Returns:
        The array shapes in tuple order (one entry for an array shape,
        none for an empty tuple).

    Raises:
        HloParseError: For an unknown dtype or an unbounded dynamic dimension.
    """
    text = INDEX_COMMENT.sub("", text).strip()
    if text.startswith("("):
        inner = text[1 : balanced_end(text, 0) - 1]
        leaves = []
        for _, piece in split_top_level(inner):
            leaves.extend(parse_shape(piece))
        return leaves
    array = _ARRAY_SHAPE.match(text)
    if array is None:
        raise HloParseError(f"Cannot parse HLO shape {text!r}.")
    return [_array_shape(array, text[array.end() :])]


def _array_shape(array: re.Match, layout: str) -> ArrayShape:
    """Builds an `ArrayShape` from a dtype[dims] match and its layout text."""
    dtype = array.group("dtype")
    if _dtype_bits(dtype) is None:
        raise HloParseError(f"Unknown HLO element type {dtype!r}.")
    sizes = []
    for dim in filter(None, array.group("dims").split(",")):
        bound = dim.strip().removeprefix("<=")
        if not bound.isdigit():
            raise HloParseError(f"Cannot size dimension {dim!r} of {array.group(0)!r}.")
        sizes.append(int(bound))
    packed = _LAYOUT_ELEMENT_BITS.search(layout) if layout.startswith("{") else None
    return ArrayShape(
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


def shape_bytes(shapes: list[ArrayShape]) -> int:
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


def operand_names_and_shapes(operands_text: str) -> list[tuple[str, str]]:
    """Splits an operand list into `(name, inline_shape_text)` pairs.

    Args:
        operands_text: Text between the opcode's parentheses, e.g.
            `"f32[8]{0} %a, %b"`.

    Returns:
        One pair per operand; the shape text is empty when not printed.
    """
    operands = []
    for _, piece in split_top_level(operands_text):
        if not piece.strip():
            continue
        parts = piece.strip().rsplit(maxsplit=1)
        name = parts[-1].removeprefix("%")
        operands.append((name, parts[0] if len(parts) == 2 else ""))
    return operands
