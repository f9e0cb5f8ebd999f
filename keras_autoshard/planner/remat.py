"""Rematerialization: which layer calls the backward pass recomputes.

A rematerialized layer (its call under `jax.checkpoint`, which Keras applies
to the layers a `keras.RematScope(mode="list_of_layers")` names) keeps only
the activations it reads from outside; everything its own backward pass
needs is recomputed from them, one layer at a time. So under a set of
rematerialized layers a device keeps:

- every residual some non-rematerialized layer needs (`Kept.layers`);
- the outside inputs of every rematerialized layer;
- while one such layer runs its backward pass, its own residuals again (the
  largest layer's, counted once).

The planner offers whole families of repeated top-level layers (the
`transformer_layer_0 … _N` of a backbone, found by name stem and call
order, not by what they are), largest saving first.
"""

from __future__ import annotations

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.symmetry import scope_stem

# (tensor id, bytes kept per byte of the tensor)
KeptTerms = list[tuple[int, float]]


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
    # Call order: the order in which the layers made their first tensors.
    for layer in dict.fromkeys(graph.tensor_layers):
        if layer and layer in keeping:
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
        remat: Names of the top-level layers rematerialized.

    Returns:
        `(tensor id, bytes per tensor byte)` of every activation kept,
        including the largest rematerialized layer's recomputed residuals.
        Residuals no tensor holds (`graph.other_residual_bytes`) are not
        included.
    """
    terms: KeptTerms = []
    recomputed: dict[str, KeptTerms] = {}
    residuals = graph.residuals_within_layers if remat else graph.residuals
    for kept in residuals:
        if graph.tensors[kept.tensor].kind != "activation":
            continue
        factor = kept.scale * kept.times
        if kept.layers and all(layer in remat for layer in kept.layers):
            recomputed.setdefault(kept.layers[0], []).append((kept.tensor, factor))
        else:
            terms.append((kept.tensor, factor))
    held = {tid for tid, factor in terms if factor >= 1.0}
    inputs = dict(graph.layer_inputs)
    for layer in sorted(remat):
        for tid in inputs.get(layer, ()):
            if tid not in held:
                terms.append((tid, 1.0))
                held.add(tid)
    result = terms
    if recomputed:
        largest = max(
            sorted(recomputed),
            key=lambda layer: sum(
                graph.tensors[t].nbytes * f for t, f in recomputed[layer]
            ),
        )
        result += recomputed[largest]
    return result


def gathered_param_terms(graph: AxisGraph, remat: frozenset[str]) -> KeptTerms:
    """Parameters the backward pass keeps as its forward pass read them.

    A matrix product keeps its weight for the input gradient. A weight
    stored cut over an FSDP axis is all-gathered to be read, and that
    gathered copy is what is kept: one per parameter of every layer that is
    not rematerialized, and while a rematerialized layer runs its backward
    pass (gathering again), the largest such layer's.

    Args:
        graph: The model's axis graph.
        remat: Names of the top-level layers rematerialized.

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
