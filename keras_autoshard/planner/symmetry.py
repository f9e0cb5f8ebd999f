"""Repeated blocks: parameters the search gives one decision together.

A model that repeats a block (transformer layers, residual stages) names
each copy's layer scope with an index: `transformer_layer_3/...` mirrors
`transformer_layer_0/...` path for path and shape for shape (Keras's own
names: `block`, `block_1`, ...). Left alone, an
exact search with a tolerance picks among equally cheap plans arbitrarily,
so identical blocks could get different specs (measured: 14 of 80 layer-norm
scales of a 70B plan cut, the rest whole; with a budget, FSDP on some layers'
kernels only). The search ties the copies to the first one instead.

Only composite blocks are tied: a scope holding sub-layers (relative paths
with a `/`), at least two parameters, and the same relative paths and shapes
in every copy. Flat layers that merely share a shape (the `dense_1`,
`dense_2` of an MLP) are not tied: Megatron alternates them.

A subclassed model's blocks differ in their sub-layers' names, which Keras
numbers across the model (`block/dense … dense_5`, `block_1/dense_6 …
dense_11`), and their paths start with the model's name
(`layer_paths.py`): such copies are tied parameter by parameter in the
order the trace reads them, when their paths less those numbers and their
shapes agree in that order.
"""

from __future__ import annotations

import re
from collections import defaultdict

from keras_autoshard.graph.axis_graph import AxisGraph, TensorNode
from keras_autoshard.graph.blocks import scope_index, scope_stem
from keras_autoshard.graph.layer_paths import split_variable_path, top_level_scopes

# The number Keras appends to a repeated layer name: `dense_6` in `dense_6/kernel`.
_NUMBERED = re.compile(r"_\d+(?=/|$)")


def repeated_blocks(graph: AxisGraph) -> list[list[list[TensorNode]]]:
    """The graph's repeated blocks.

    Args:
        graph: The model's axis graph.

    Returns:
        One entry per family of repeated blocks: the blocks in index order,
        each a list of its parameters in a common order (so that position
        `i` of every block is the same parameter of the block).
    """
    by_scope: dict[tuple[str, str], dict[int, dict[str, TensorNode]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    tops = top_level_scopes(graph)
    for tensor in graph.tensors:
        if tensor.kind not in ("param", "state") or not tensor.name:
            continue
        head, _, rest = split_variable_path(tensor.name, tops)[1].partition("/")
        if "/" not in rest:
            continue
        stem, index = scope_stem(head), scope_index(head)
        by_scope[(stem, tensor.kind)][index][rest] = tensor
    families = []
    for blocks in by_scope.values():
        if len(blocks) < 2:
            continue
        ordered = [blocks[i] for i in sorted(blocks)]
        family = _tied_by_name(ordered) or _tied_by_position(ordered)
        if family:
            families.append(family)
    return families


def _tied_by_name(blocks: list[dict[str, TensorNode]]) -> list[list[TensorNode]]:
    layout = sorted((rest, t.shape) for rest, t in blocks[0].items())
    if len(layout) < 2 or any(
        sorted((rest, t.shape) for rest, t in block.items()) != layout
        for block in blocks[1:]
    ):
        return []
    order = [rest for rest, _ in layout]
    return [[block[rest] for rest in order] for block in blocks]


def _tied_by_position(
    blocks: list[dict[str, TensorNode]],
) -> list[list[TensorNode]]:
    def signature(block):
        return [(_NUMBERED.sub("", rest), t.shape) for rest, t in block.items()]

    first = signature(blocks[0])
    if len(first) < 2 or any(signature(block) != first for block in blocks[1:]):
        return []
    return [list(block.values()) for block in blocks]
