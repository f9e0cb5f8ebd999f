"""The final assembly of a walk's `AxisGraph`: the dims' union-find
compacted into numbered axis classes (a class met twice in one tensor made
unshardable), the events and slice edges stated in classes, and what the
walk recorded (residuals after fusion, layers, products, readers) gathered
into the graph's fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keras_autoshard.graph.axis_graph import (
    AxisClass,
    AxisGraph,
    CommEvent,
    SliceEdge,
    TensorNode,
)
from keras_autoshard.graph.events import final_events
from keras_autoshard.graph.fusion import (
    cast_pairs,
    expensively_read_products,
    kept_after_fusion,
    norm_read_products,
    product_images,
)
from keras_autoshard.graph.kv_cache import key_value_pairs

if TYPE_CHECKING:
    from keras_autoshard.graph.walk_state import GraphBuilder


def assemble_axis_graph(builder: GraphBuilder) -> AxisGraph:
    """The `AxisGraph` of a finished walk: each dim's class, the
    classes, the final events and slice edges, and what the walk
    recorded about residuals, layers and products."""
    _mark_repeated_classes(builder)
    class_of, classes = _compact_classes(builder)
    fused_products = product_images(builder)
    tensors = tuple(
        TensorNode(
            id=tid,
            shape=record.shape,
            itemsize=record.itemsize,
            kind=record.kind,
            name=record.name,
            dim_classes=tuple(
                None if e is None else class_of[builder.uf.find(e)]
                for e in record.elements
            ),
            requires_grad=record.requires_grad,
        )
        for tid, record in enumerate(builder.tensors)
    )
    return AxisGraph(
        tensors=tensors,
        classes=classes,
        comm_events=_final_events(builder, class_of),
        slice_edges=_final_slice_edges(builder, class_of),
        unknown_primitives=tuple(sorted(builder.unknown.items())),
        notes=tuple(dict.fromkeys(builder.notes)),
        scope_outputs=tuple(
            (scope, tuple(calls)) for scope, calls in builder.scope_outputs.items()
        ),
        grouped_convs=tuple(builder.grouped_convs),
        key_values=key_value_pairs(builder),
        matmul_operands=tuple(sorted(builder.matmul_operands)),
        matmul_pairs=tuple(builder.matmul_pairs),
        products=tuple(
            (out, *operands)
            for out, operands in sorted(builder.unbatched_products.items())
        ),
        fused_products=fused_products,
        expensively_read_products=expensively_read_products(builder),
        norm_read_products=_norm_read_products(builder, tensors, fused_products),
        casts=cast_pairs(builder),
        relaid_operands=tuple(sorted(builder.relaid_operands)),
        param_views=tuple(
            sorted(
                (v, s)
                for v, s in builder.view_of.items()
                if builder.tensors[s].kind == "param"
            )
        ),
        residuals=kept_after_fusion(builder),
        residuals_within_layers=kept_after_fusion(builder, within_layers=True),
        accelerator_residuals=kept_after_fusion(builder, accelerator=True),
        accelerator_residuals_within_layers=kept_after_fusion(
            builder, within_layers=True, accelerator=True
        ),
        poolings=tuple((t, out) for t, (out, _) in sorted(builder.poolings.items())),
        other_residual_bytes=builder.other_residual_bytes,
        tensor_layers=builder.layers.scopes(len(builder.tensors)),
        layer_inputs=tuple(sorted(builder.layers.outside_inputs().items())),
        unread=tuple(
            t.id for t in tensors if t.kind == "param" and t.id not in builder.readers
        ),
        param_readers=tuple(
            (t.id, tuple(sorted(builder.readers[t.id])))
            for t in tensors
            if t.kind == "param" and t.id in builder.readers
        ),
        input_readers=tuple(
            (t.id, tuple(sorted(builder.readers[t.id] - {""})))
            for t in tensors
            if t.kind == "input" and t.id in builder.readers
        ),
    )


def _norm_read_products(
    builder: GraphBuilder, tensors: tuple[TensorNode, ...], fused_products: tuple
) -> tuple[tuple[int, int, tuple[int, ...], bool], ...]:
    """`fusion.norm_read_products` with each reduced dim as its class."""
    found = []
    for out, total, dims, chained in norm_read_products(builder, fused_products):
        classes = {tensors[tid].dim_classes[dim] for tid, dim in dims}
        reduced = tuple(sorted(c for c in classes if c is not None))
        found.append((out, total, reduced, chained))
    return tuple(found)


def _mark_repeated_classes(builder: GraphBuilder) -> None:
    for tid, record in enumerate(builder.tensors):
        seen: set[int] = set()
        for element in record.elements:
            if element is None:
                continue
            root = builder.uf.find(element)
            if root in seen:
                builder.uf.mark_unshardable(root, f"appears twice in tensor {tid}")
            seen.add(root)


def _compact_classes(
    builder: GraphBuilder,
) -> tuple[dict[int, int], tuple[AxisClass, ...]]:
    members: dict[int, list[tuple[int, int]]] = {}
    for tid, record in enumerate(builder.tensors):
        for dim, element in enumerate(record.elements):
            if element is not None:
                members.setdefault(builder.uf.find(element), []).append((tid, dim))
    class_of = {root: index for index, root in enumerate(members)}
    classes = tuple(
        AxisClass(
            id=class_of[root],
            size=builder.uf.dim_size(root),
            unshardable_reason=builder.uf.reason(root),
            dims=tuple(dims),
        )
        for root, dims in members.items()
    )
    return class_of, classes


def _final_events(
    builder: GraphBuilder, class_of: dict[int, int]
) -> tuple[CommEvent, ...]:
    return final_events(
        builder.events,
        lambda elements: tuple(
            dict.fromkeys(class_of[builder.uf.find(e)] for e in elements)
        ),
    )


def _final_slice_edges(
    builder: GraphBuilder, class_of: dict[int, int]
) -> tuple[SliceEdge, ...]:
    edges: dict[tuple[int, int, int], str] = {}
    for source, target, tensor, reason in builder.slice_edges:
        source_class = class_of[builder.uf.find(source)]
        target_class = class_of[builder.uf.find(target)]
        if source_class != target_class:
            edges.setdefault((source_class, target_class, tensor), reason)
    return tuple(
        SliceEdge(s, t, tensor, reason) for (s, t, tensor), reason in edges.items()
    )
