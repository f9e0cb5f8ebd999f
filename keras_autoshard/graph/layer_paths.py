"""Trace scopes and Keras layer paths.

The planner traces the model's `call` (`stateless_call`), so the JAX name
scopes it records start at the model's top-level layers. Keras's own paths
(of variables, and of the layer outputs it asks a layout for) start with
the model's name for a subclassed model (`subclassed/block/dense`) and do
not for a functional one; a variable's path tells which.
"""

from __future__ import annotations

from collections.abc import Mapping

from keras_autoshard.graph.axis_graph import AxisGraph


def top_level_scopes(graph: AxisGraph) -> set[str]:
    """The first component of every scope of the trace."""
    return {scope.partition("/")[0] for scope, _ in graph.scope_outputs}


def split_variable_path(path: str, tops: set[str]) -> tuple[str, str]:
    """`(prefix, path under it)`: the prefix is what comes before the first
    component that is a top-level scope (`""` when none is).

    Args:
        path: A variable path, e.g. `"subclassed/block/dense/kernel"`.
        tops: `top_level_scopes` of the trace.

    Returns:
        E.g. `("subclassed/", "block/dense/kernel")`.
    """
    parts = path.split("/")
    for index, part in enumerate(parts[:-1]):
        if part in tops:
            return "".join(f"{p}/" for p in parts[:index]), "/".join(parts[index:])
    return "", path


def scope_rewrites(graph: AxisGraph) -> dict[str, tuple[str, str]]:
    """Top-level trace scope → `(drop, add)`: what to drop from the front of
    a scope under it and what to put there instead, to give Keras's path.

    Read from the variables: a layer's variables carry its Keras path. A
    subclassed model's layers add the model's name (`("", "subclassed/")`);
    a functional backbone called inside another model (a KerasHub task)
    drops the backbone's scope, since Keras paths a layer from where it
    was first called, the backbone's construction
    (`("opt_backbone/", "")`); a plain functional model changes nothing.

    Args:
        graph: The model's axis graph.

    Returns:
        The rewrite of each top-level scope a variable places.
    """
    layer_paths = {
        t.name.rpartition("/")[0]
        for t in graph.tensors
        if t.kind in ("param", "state") and t.name and "/" in t.name
    }
    scopes = [scope for scope, _ in graph.scope_outputs]
    rewrites: dict[str, tuple[str, str]] = {}
    for scope in scopes:  # the longest suffix that is a layer's path
        parts = scope.split("/")
        if parts[0] in rewrites:
            continue
        for index in range(len(parts)):
            if "/".join(parts[index:]) in layer_paths:
                rewrites[parts[0]] = ("".join(f"{p}/" for p in parts[:index]), "")
                break
    known = set(scopes)
    for path in sorted(layer_paths):  # a scope that is the end of a path
        parts = path.split("/")
        for index in range(1, len(parts)):
            if "/".join(parts[index:]) in known:
                added = "".join(f"{p}/" for p in parts[:index])
                rewrites.setdefault(parts[index], ("", added))
                break
    return rewrites


def keras_layer_path(scope: str, rewrites: Mapping[str, tuple[str, str]]) -> str:
    """The path Keras gives the layer of trace scope `scope` (its output's
    layout is asked as this path + `"/output"`).

    Args:
        scope: A trace scope.
        rewrites: `scope_rewrites` of the trace.

    Returns:
        The Keras layer path.
    """
    drop, add = rewrites.get(scope.partition("/")[0], ("", ""))
    return add + (scope[len(drop) :] if scope.startswith(drop) else scope)
