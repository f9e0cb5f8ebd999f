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


def keras_path_prefixes(graph: AxisGraph) -> dict[str, str]:
    """Top-level trace scope → what Keras puts before it in a layer path.

    Args:
        graph: The model's axis graph.

    Returns:
        The prefix (`""` or `"<model name>/"`) of each top-level scope that
        owns a variable.
    """
    tops = top_level_scopes(graph)
    prefixes: dict[str, str] = {}
    for tensor in graph.tensors:
        if tensor.kind in ("param", "state") and tensor.name:
            prefix, under = split_variable_path(tensor.name, tops)
            top = under.partition("/")[0]
            if top in tops:
                prefixes.setdefault(top, prefix)
    return prefixes


def keras_layer_path(scope: str, prefixes: Mapping[str, str]) -> str:
    """The path Keras gives the layer of trace scope `scope`."""
    return prefixes.get(scope.partition("/")[0], "") + scope
