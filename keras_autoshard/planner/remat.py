"""Rematerialization: which layer calls the backward pass recomputes.

A rematerialized layer (its call under `jax.checkpoint`, which Keras applies
to the layers a `keras.RematScope(mode="list_of_layers")` names) keeps only
the activations it reads from outside; everything its own backward pass
needs is recomputed from them, one layer at a time. So under a set of
rematerialized layers a device keeps:

- every residual some non-rematerialized layer needs (`Kept.layers`);
- the outside inputs of every rematerialized layer;
- while one such layer runs its backward pass, its own residuals again (the
  largest layer's, counted once), and the gradients made so far
  (`backward_stages`: the fullest stage is the peak).

The planner offers whole families of repeated layers (the
`transformer_layer_0 … _N` of a backbone, or of the backbone a task wraps,
`graph/blocks.py`; found by name stem and call order, not by what they
are), largest saving first.
"""

from __future__ import annotations

import dataclasses

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.graph.blocks import scope_stem

# (tensor id, bytes kept per byte of the tensor)
KeptTerms = list[tuple[int, float]]


def layer_calls(graph: AxisGraph) -> list[str]:
    """The graph's units (layer calls, `graph/blocks.py`) in call order:
    the order in which they made their first tensors."""
    return [layer for layer in dict.fromkeys(graph.tensor_layers) if layer]


def remat_families(graph: AxisGraph) -> list[tuple[str, ...]]:
    """Families of repeated top-level layers worth rematerializing.

    Args:
        graph: The model's axis graph (traced without rematerialization).

    Returns:
        Each family's layer names in call order, the family whose
        rematerialization frees the most (global) bytes first; families
        that would free nothing are left out.
    """
    keeping = {layer for k in graph.residuals for layer in k.layers}
    by_stem: dict[str, list[str]] = {}
    for layer in layer_calls(graph):
        if layer in keeping:
            by_stem.setdefault(scope_stem(layer), []).append(layer)
    families = []
    for layers in by_stem.values():
        if len(layers) < 2:
            continue
        freed = _global_kept(graph, frozenset()) - _global_kept(
            graph, frozenset(layers)
        )
        if freed > 0:
            families.append((freed, tuple(layers)))
    families.sort(key=lambda item: -item[0])
    return [layers for _, layers in families]


def kept_terms(graph: AxisGraph, remat: frozenset[str]) -> KeptTerms:
    """What one step keeps for the backward pass under `remat` (with
    layers rematerialized, read from `graph.residuals_within_layers`).

    Args:
        graph: The model's axis graph.
        remat: Names of the layer calls rematerialized (`graph/blocks.py`).

    Returns:
        `(tensor id, bytes per tensor byte)` of every activation kept,
        including the largest rematerialized layer's recomputed residuals.
        Residuals no tensor holds (`graph.other_residual_bytes`) are not
        included.
    """
    held, recomputed = _held_and_recomputed(graph, remat)
    if not recomputed:
        return held
    return held + max(
        (recomputed[layer] for layer in sorted(recomputed)),
        key=lambda terms: sum(graph.tensors[t].nbytes * f for t, f in terms),
    )


@dataclasses.dataclass(frozen=True)
class BackwardStage:
    """What a device holds, besides the activations every stage holds,
    while the backward pass runs one top-level layer (or, for `layer=""`,
    once it has run them all).

    Args:
        layer: The layer whose backward pass runs ("" after the last).
        recomputed: `(tensor id, bytes per tensor byte)` of the layer's own
            residuals when it is rematerialized (else empty).
        gradients: Parameters whose gradient exists by then (every layer
            reading them is differentiated, or is this one).
    """

    layer: str
    recomputed: KeptTerms
    gradients: tuple[int, ...]


def backward_stages(
    graph: AxisGraph, remat: frozenset[str]
) -> tuple[KeptTerms, list[BackwardStage]]:
    """The backward pass of a step with `remat` rematerialized, layer by
    layer in reverse call order, as a schedule for memory runs it.

    Every stage holds what the step keeps outside rematerialized layers
    and their inputs: XLA frees a kept activation after its last use, and a
    schedule may run a weight-gradient matmul as late as the update that
    reads it (measured on XLA:CPU, whose memory scheduler is depth-first
    from the outputs: a block's MLP weight gradients and bias reductions
    ran after the previous block's backward pass), so these are counted to
    the end.
    A rematerialized layer's own residuals exist while its backward pass
    runs; a parameter's gradient from the backward pass of the last layer
    reading it (in call order; equations outside any layer count as last)
    on, and an unread parameter has none.

    Args:
        graph: The model's axis graph.
        remat: Names of the layer calls rematerialized (`graph/blocks.py`).

    Returns:
        `(held, stages)`: the `(tensor id, bytes per tensor byte)` every
        stage holds, and one `BackwardStage` per top-level layer in call
        order, then the stage after the last.
    """
    held, recomputed = _held_and_recomputed(graph, remat)
    order = layer_calls(graph)
    position = {layer: i for i, layer in enumerate(order)}
    last_reader = {
        tid: max(position.get(layer, len(order)) for layer in layers)
        for tid, layers in graph.param_readers
    }
    stages = [
        BackwardStage(
            layer=layer,
            recomputed=recomputed.get(layer, []),
            gradients=tuple(t for t, last in last_reader.items() if last >= at),
        )
        for at, layer in [*enumerate(order), (-1, "")]
    ]
    return held, stages


@dataclasses.dataclass(frozen=True)
class AcceleratorStage:
    """One stage of an accelerator's backward pass (`accelerator_stages`):
    the backward pass of the layer call at one position of the call order
    (the last position: equations outside any layer, the loss's).

    Args:
        kept_to_here: `(tensor id, bytes per tensor byte)` kept from the
            forward pass until this stage has run (the lowest position that
            reads them is this one); a stage holds these of its own
            position and of every lower one.
        own: This stage's rematerialized layer's own residuals, made again
            for its backward pass (empty unless it is rematerialized).
        gradients: Parameters whose gradient this stage starts (the
            highest position reading them is this one); XLA:GPU holds each
            until the updates, after the whole backward pass.
    """

    kept_to_here: KeptTerms
    own: KeptTerms
    gradients: tuple[int, ...]


def accelerator_stages(
    graph: AxisGraph, remat: frozenset[str]
) -> list[AcceleratorStage]:
    """An accelerator's backward pass, one stage per position of the call
    order (`layer_calls`) and one after the last: stage `i` holds the
    `kept_to_here` of stages `0 … i`, its own residuals, and the gradients
    of stages `i … last` (see `accelerator_peak.accelerator_peak`).

    Args:
        graph: The model's axis graph, `for_platform` an accelerator.
        remat: Names of the layer calls rematerialized (`graph/blocks.py`).

    Returns:
        The stages, by position (the backward pass runs them last first).
    """
    order = layer_calls(graph)
    position = {layer: i for i, layer in enumerate(order)}
    last = len(order)
    kept: list[KeptTerms] = [[] for _ in range(last + 1)]
    own: list[KeptTerms] = [[] for _ in range(last + 1)]
    residuals = graph.residuals_within_layers if remat else graph.residuals
    for residual in residuals:
        if graph.tensors[residual.tensor].kind != "activation":
            continue
        term = (residual.tensor, residual.scale * residual.times)
        readers = [position.get(layer, last) for layer in residual.layers] or [last]
        if residual.layers and all(layer in remat for layer in residual.layers):
            own[min(readers)].append(term)
        else:
            kept[min(readers)].append(term)
    for layer, tids in graph.layer_inputs:
        if layer in remat:
            # Held whole from the forward pass: not made again (it was
            # counted twice, Llama-2-70B widths on 32x8: 512 MiB a stage).
            at = position[layer]
            own[at] = [(tid, f) for tid, f in own[at] if tid not in tids]
            kept[at] += [(tid, 1.0) for tid in tids]
    gradients: list[list[int]] = [[] for _ in range(last + 1)]
    for tid, layers in graph.param_readers:
        gradients[max(position.get(layer, last) for layer in layers)].append(tid)
    return [
        AcceleratorStage(kept[i], own[i], tuple(gradients[i])) for i in range(last + 1)
    ]


def _held_and_recomputed(
    graph: AxisGraph, remat: frozenset[str]
) -> tuple[KeptTerms, dict[str, KeptTerms]]:
    """What the step keeps throughout (residuals of layers not
    rematerialized, inputs of those that are), and each rematerialized
    layer's own residuals (less what is held anyway, its input)."""
    held: KeptTerms = []
    recomputed: dict[str, KeptTerms] = {}
    residuals = graph.residuals_within_layers if remat else graph.residuals
    for kept in residuals:
        if graph.tensors[kept.tensor].kind != "activation":
            continue
        factor = kept.scale * kept.times
        if kept.layers and all(layer in remat for layer in kept.layers):
            recomputed.setdefault(kept.layers[0], []).append((kept.tensor, factor))
        else:
            held.append((kept.tensor, factor))
    whole = {tid for tid, factor in held if factor >= 1.0}
    inputs = dict(graph.layer_inputs)
    for layer in sorted(remat):
        for tid in inputs.get(layer, ()):
            if tid not in whole:
                held.append((tid, 1.0))
                whole.add(tid)
    return held, {
        layer: [(t, f) for t, f in terms if t not in whole]
        for layer, terms in recomputed.items()
    }


def gathered_param_terms(graph: AxisGraph, remat: frozenset[str]) -> KeptTerms:
    """Parameters the backward pass keeps as its forward pass read them.

    A matrix product keeps its weight for the input gradient. A weight
    stored cut over an FSDP axis is all-gathered to be read, and that
    gathered copy is what is kept: one per parameter of every layer that is
    not rematerialized, and while a rematerialized layer runs its backward
    pass (gathering again), the largest such layer's.

    Args:
        graph: The model's axis graph.
        remat: Names of the layer calls rematerialized (`graph/blocks.py`).

    Returns:
        `(parameter tensor id, copies)`; each costs its compute layout's
        bytes less its stored shard's (nothing when it is not FSDP-cut).
    """
    terms: KeptTerms = []
    recomputed: dict[str, KeptTerms] = {}
    for kept in graph.residuals:
        if graph.tensors[kept.tensor].kind != "param":
            continue
        if kept.layers and all(layer in remat for layer in kept.layers):
            recomputed.setdefault(kept.layers[0], []).append((kept.tensor, 1.0))
        else:
            terms.append((kept.tensor, 1.0))
    if recomputed:
        largest = max(
            sorted(recomputed),
            key=lambda layer: sum(
                graph.tensors[t].nbytes for t, _ in recomputed[layer]
            ),
        )
        terms += recomputed[largest]
    return terms


def _global_kept(graph: AxisGraph, remat: frozenset[str]) -> float:
    return sum(graph.tensors[t].nbytes * f for t, f in kept_terms(graph, remat))
