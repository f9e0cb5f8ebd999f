"""Sequence parallelism: the token dim of the activations between
tensor-parallel regions, cut over the tensor-parallel axis.

Under Megatron tensor parallelism the activations between two parallel
regions (the residual stream, the norms and dropouts on it) are whole on
every device of the tensor-parallel axis: each region ends in an all-reduce.
Megatron-SP (Korthikanti et al., 2022) cuts them along the sequence instead,
so that each all-reduce becomes a reduce-scatter and each region starts with
an all-gather: the same bytes on the wire, and those activations, the bulk
of what a transformer keeps for its backward pass, shrink by the axis size.

The planner applies it to the repeated layers of the model (the
families of `remat.remat_families`: transformer layers, found by name stem
and call order, not by what they are) by graph rules:

- the tensor-parallel axis is the one that cuts the family's parameters
  (not for storage only);
- a family qualifies when every matrix parameter (rank 2 or more) of its
  layers is cut over that axis: a matmul whose weights are whole on the
  axis (grouped-query K/V projections with fewer heads than the axis) would
  have to gather the sequence and compute in full on every device;
- in a qualifying layer, an activation of rank 3 or more whose dims are all
  free of the axis, its last (feature) dim whole and its second (token) dim
  free and divisible by the axis size, is cut along the token dim, except
  the partial sums of a contraction over the axis and the outputs of a
  sub-layer that owns parameters cut over the axis (a row-parallel layer's
  output stays whole: the gradient entering it is gathered once, not its
  weights; measured on KerasHub GPT-2 on 1x4: pinning it cut made XLA
  gather the output kernel and add an all-to-all in the backward pass).

The estimate counts what a device holds, which is not always the layout
pinned: a cut tensor that a column-parallel matmul reads is counted whole
(`SequenceCut.gathered`), a row-parallel output cut (`SequenceCut.scattered`).

The plan pins (`Distribution.get_tensor_layout`, `"<layer path>/output"`)
every sub-layer output of a qualifying layer at its layout, cut or not, and
the layer outputs that feed the first layer of a family at their planned
layout: left to itself, the partitioner propagates the token cut into the
parallel regions and gathers weights instead of activations.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from keras_autoshard.graph.axis_graph import AxisGraph, TensorNode
from keras_autoshard.graph.layer_paths import split_variable_path, top_level_scopes
from keras_autoshard.planner.cost_model import Assignment, tensor_axes
from keras_autoshard.planner.mesh_axis import MeshAxis
from keras_autoshard.planner.remat import remat_families

# A Keras layer name (the scopes of the trace also hold ops, e.g. einsum
# equations such as "abc,cde->abde", which Keras never asks a layout for).
_LAYER_NAME = re.compile(r"[\w.-]+")
TOKEN_DIM = 1


@dataclasses.dataclass(frozen=True)
class SequenceCut:
    """Where sequence parallelism applies under one sharding.

    Args:
        axis: The tensor-parallel mesh axis the tokens are cut over (`None`
            when no family qualifies).
        cuts: Activation tensor id → `((dim, mesh axis), ...)` added to its
            planned layout.
        gathered: Of `cuts`, the tensors a column-parallel matmul reads: the
            partitioner gathers them whole for it, and the backward pass
            keeps that whole copy for the weight gradient (Megatron-SP
            gathers them again instead), so the estimate counts them whole
            (the zoo's subclassed model on 1x4 with XLA:CPU's default
            schedule: 0.83 of the compiled peak counting them cut, 0.94
            whole).
        scattered: Activation tensor id → `((dim, mesh axis), ...)`: the
            outputs of row-parallel sub-layers, laid out whole, which XLA
            holds cut all the same (the all-reduce becomes a reduce-scatter
            whose slice fuses into the residual add), so the estimate counts
            them cut. Measured on the zoo's Gemma on 2x4 (`xla_dump_to`, the
            buffers live at the compiled step's peak): each is kept as a
            (4, 16, 256) slice, not whole. The output of the layer feeding
            the first one is not: GPT-2's embedding dropout keeps its whole
            (4, 64, 256) output.
        layers: The top-level layers it applies to, in call order.
        pinned_scopes: Layer paths whose outputs the plan pins.
        notes: Why a family of repeated layers was left out, one per family.
    """

    axis: str | None = None
    cuts: Mapping[int, tuple[tuple[int, str], ...]] = dataclasses.field(
        default_factory=dict
    )
    gathered: frozenset[int] = frozenset()
    scattered: Mapping[int, tuple[tuple[int, str], ...]] = dataclasses.field(
        default_factory=dict
    )
    layers: tuple[str, ...] = ()
    pinned_scopes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def sequence_cut(
    graph: AxisGraph, axes: tuple[MeshAxis, ...], assignment: Assignment
) -> SequenceCut:
    """The sequence-parallel cut of `assignment` (see the module docstring).

    Args:
        graph: The model's axis graph.
        axes: Mesh axes of size > 1.
        assignment: The sharding it extends.

    Returns:
        A `SequenceCut` (empty, with notes, where nothing qualifies).
    """
    sizes = {a.name: a.size for a in axes}
    scopes = _layer_scopes(graph)
    partial = _partial_sums(graph, assignment)
    cuts: dict[int, tuple[tuple[int, str], ...]] = {}
    scattered: dict[int, tuple[tuple[int, str], ...]] = {}
    layers: list[str] = []
    pinned: list[str] = []
    notes: list[str] = []
    chosen_axis = None
    made_by: dict[str, list[TensorNode]] = {}
    for tensor in graph.tensors:
        if graph.tensor_layers:
            made_by.setdefault(graph.tensor_layers[tensor.id], []).append(tensor)
    families = remat_families(graph)
    if not families:
        notes.append(
            "Sequence parallelism not applied: the model repeats no layer "
            "that keeps activations for the backward pass (it applies to "
            "repeated layers such as transformer layers)."
        )
    elif not any(not a.data_only and not a.members for a in axes):
        notes.append(
            "Sequence parallelism not applied: the mesh has no "
            "tensor-parallel axis (every axis of size > 1 is a data axis)."
        )
        families = []
    elif spanned := sorted(
        {a.name for a in axes if a.members} & set(assignment.class_axis.values())
    ):
        notes.append(
            "Sequence parallelism not applied: the batch is cut over "
            f"{spanned[0]!r}, every mesh axis, so no axis is left for the tokens."
        )
        families = []
    for family in families:
        axis, reason = _family_axis(graph, family, assignment, axes)
        if axis is not None and chosen_axis not in (None, axis):
            reason = f"its tensor-parallel axis {axis!r} is not {chosen_axis!r}"
            axis = None
        if axis is None:
            notes.append(
                f"Sequence parallelism left out of {family[0]} … {family[-1]}: "
                f"{reason}."
            )
            continue
        chosen_axis = axis
        family_cuts = {}
        family_scattered = {}
        for layer in family:
            whole = _outputs_of_cut_owners(graph, scopes, layer, assignment, axis)
            for tensor in made_by.get(layer, ()):
                if not _token_cut_fits(tensor, assignment, axis, sizes[axis]):
                    continue
                if tensor.id in whole:
                    family_scattered[tensor.id] = ((TOKEN_DIM, axis),)
                elif tensor.id not in partial:
                    family_cuts[tensor.id] = ((TOKEN_DIM, axis),)
        if not family_cuts:
            notes.append(
                f"Sequence parallelism left out of {family[0]} … {family[-1]}: "
                f"no activation between its parallel regions has a token dim "
                f"divisible by {axis!r} ({sizes[axis]})."
            )
            continue
        cuts.update(family_cuts)
        scattered.update(family_scattered)
        layers.extend(family)
        pinned.extend(_feeding_scopes(graph, scopes, family))
        pinned.extend(
            scope
            for scope in scopes
            for layer in family
            if scope == layer or scope.startswith(f"{layer}/")
        )
    return SequenceCut(
        chosen_axis,
        cuts,
        _gathered_for_matmuls(graph, assignment, cuts, chosen_axis),
        scattered,
        tuple(layers),
        tuple(dict.fromkeys(pinned)),
        tuple(notes),
    )


def with_sequence_cut(
    assignment: Assignment, cut: SequenceCut, held: bool = False
) -> Assignment:
    """`assignment` with the token cuts of `cut` added to its activations
    (`SequenceCut.gathered` left whole).

    Args:
        assignment: The sharding.
        cut: The sequence cut.
        held: Lay the tensors out as the estimate counts what a device
            holds: `SequenceCut.scattered` cut too.

    Returns:
        The assignment with `activation_cuts` set.
    """
    counted = {tid: dims for tid, dims in cut.cuts.items() if tid not in cut.gathered}
    if held:
        counted.update(cut.scattered)
    return dataclasses.replace(assignment, activation_cuts=counted)


def pinned_layouts(
    graph: AxisGraph, assignment: Assignment, cut: SequenceCut
) -> dict[str, tuple[str | None, ...]]:
    """Trace scope → layout of its output, for every scope `cut` pins.

    Args:
        graph: The model's axis graph.
        assignment: The sharding.
        cut: The sequence cut (all of its cuts are laid out).

    Returns:
        The layouts, in the order of `cut.pinned_scopes` (keyed by trace
        scope: `layer_paths.keras_layer_path` gives the path Keras asks).
    """
    scopes = _layer_scopes(graph)
    laid_out = dataclasses.replace(assignment, activation_cuts=dict(cut.cuts))
    return {
        scope: tensor_axes(graph.tensors[scopes[scope]], laid_out)
        for scope in cut.pinned_scopes
    }


def describe(cut: SequenceCut, axis_size: int) -> str:
    """The lever in words, for the plan's estimate."""
    first, last = cut.layers[0], cut.layers[-1]
    return (
        f"sequence parallelism over {cut.axis!r} in {len(cut.layers)} layer "
        f"call(s) ({first} … {last}): the token dim of the activations "
        f"between tensor-parallel regions cut {axis_size} ways, each "
        "region's all-reduce a reduce-scatter and an all-gather"
    )


def _layer_scopes(graph: AxisGraph) -> dict[str, int]:
    """Scope → output tensor id, for layer scopes called once."""
    return {
        scope: outputs[0]
        for scope, outputs in graph.scope_outputs
        if len(outputs) == 1 and _LAYER_NAME.fullmatch(scope.rpartition("/")[2])
    }


def _partial_sums(graph: AxisGraph, assignment: Assignment) -> set[int]:
    """Tensors a forward contraction leaves as partial sums over some axis."""
    return {
        event.tensor
        for event in graph.comm_events
        if event.phase == "forward"
        and event.kind == "contract"
        and any(c in assignment.class_axis for c in event.classes)
    }


def _gathered_for_matmuls(
    graph: AxisGraph,
    assignment: Assignment,
    cuts: Mapping[int, tuple[tuple[int, str], ...]],
    axis: str | None,
) -> frozenset[int]:
    """Cut tensors that some contraction reads against weights cut over
    `axis`: their input gradient is a partial sum over it (a backward
    contraction event on the tensor)."""
    return frozenset(
        event.tensor
        for event in graph.comm_events
        if event.phase == "backward"
        and event.kind == "contract"
        and event.tensor in cuts
        and any(assignment.class_axis.get(c) == axis for c in event.classes)
    )


def _model_axes_of(tensor: TensorNode, assignment: Assignment) -> set[str]:
    return {
        assignment.class_axis[c]
        for c in tensor.dim_classes
        if c is not None and c in assignment.class_axis
    }


def _family_axis(
    graph: AxisGraph,
    family: tuple[str, ...],
    assignment: Assignment,
    axes: tuple[MeshAxis, ...],
) -> tuple[str | None, str | None]:
    """The axis that cuts every matrix parameter of the family's layers, or
    `(None, reason)`."""
    model_axes = {a.name for a in axes if not a.data_only and not a.members}
    readers = dict(graph.param_readers)
    params = [
        graph.tensors[tid]
        for tid, layers in readers.items()
        if set(layers) & set(family) and len(graph.tensors[tid].shape) >= 2
    ]
    if not params:
        return None, "its layers hold no matrix parameter"
    common = set(model_axes)
    for tensor in params:
        common &= _model_axes_of(tensor, assignment)
        if not common:
            return None, (
                f"{tensor.name} {tensor.shape} is not cut over a tensor-parallel "
                "axis the others share, so its matmul would need the whole "
                "sequence on every device"
            )
    return sorted(common)[0], None


def _outputs_of_cut_owners(
    graph: AxisGraph,
    scopes: Mapping[str, int],
    layer: str,
    assignment: Assignment,
    axis: str,
) -> set[int]:
    """Outputs of the sub-layers of `layer` owning a parameter cut over
    `axis`: a row-parallel output stays whole (see the module docstring)."""
    tops = top_level_scopes(graph)
    # Variable paths under the trace's scopes (less a subclassed model's name).
    owners = [
        split_variable_path(t.name, tops)[1]
        for t in graph.tensors
        if t.kind == "param" and t.name and axis in _model_axes_of(t, assignment)
    ]
    owners = [owner for owner in owners if owner.startswith(f"{layer}/")]
    return {
        tensor_id
        for scope, tensor_id in scopes.items()
        if scope.startswith(f"{layer}/")
        and any(owner.startswith(f"{scope}/") for owner in owners)
    }


def _token_cut_fits(
    tensor: TensorNode, assignment: Assignment, axis: str, axis_size: int
) -> bool:
    if tensor.kind != "activation" or len(tensor.shape) < 3:
        return False
    layout = tensor_axes(tensor, assignment)
    return (
        axis not in layout
        and layout[-1] is None
        and layout[TOKEN_DIM] is None
        and tensor.dim_classes[TOKEN_DIM] is not None
        and tensor.shape[TOKEN_DIM] % axis_size == 0
    )


def _feeding_scopes(
    graph: AxisGraph, scopes: Mapping[str, int], family: tuple[str, ...]
) -> list[str]:
    """Top-level layers whose output the family's first layer reads."""
    inputs = dict(graph.layer_inputs).get(family[0], ())
    return [
        scope
        for scope, tensor_id in scopes.items()
        if "/" not in scope and scope not in family and tensor_id in inputs
    ]
