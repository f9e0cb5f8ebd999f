"""Axis graphs of tiny functions written in a test: a few primitives in,
the graph's classes, events and edges out."""

from __future__ import annotations

from collections.abc import Callable

import jax

from keras_autoshard.graph.axis_graph import AxisClass, AxisGraph, TensorNode
from keras_autoshard.graph.builder import build_axis_graph
from keras_autoshard.graph.jaxpr.registry import handled_primitives, rule_for


def graph_of(f: Callable, *args: tuple) -> AxisGraph:
    """The axis graph of `f` traced on `(kind, name, shape[, dtype])` args."""
    structs = [
        jax.ShapeDtypeStruct(arg[2], arg[3] if len(arg) > 3 else "float32")
        for arg in args
    ]
    closed = jax.make_jaxpr(f)(*structs)
    return build_axis_graph(closed, [(arg[0], arg[1]) for arg in args])


def named(graph: AxisGraph, name: str) -> TensorNode:
    """The param, state or input called `name`."""
    return next(t for t in graph.tensors if t.name == name)


def output(graph: AxisGraph, index: int = 0) -> TensorNode:
    return graph.tensors[graph.outputs[index]]


def class_of(graph: AxisGraph, tensor: TensorNode, dim: int) -> AxisClass:
    return graph.classes[tensor.dim_classes[dim]]


def family_primitives(module) -> set[str]:
    """The primitives whose registered rule is defined in `module`."""
    return {
        p for p in handled_primitives() if rule_for(p).__module__ == module.__name__
    }
