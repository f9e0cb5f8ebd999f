"""Name what each axis class is (batch, vocab, embed, heads, mlp, ...).

Read from the graph's structure alone, never from layer names. Roles explain a
plan; the search does not use them.
"""

from __future__ import annotations

from collections import Counter

from keras_autoshard.graph.axis_graph import AxisGraph


def class_roles(graph: AxisGraph) -> dict[int, str]:
    """Axis class id → logical role, for the classes of parameters and inputs.

    Rules, in order: the inputs' leading dim is `examples` (the batch; a
    role, not the mesh axis of that name); a dim a lookup indexes
    into a parameter is `vocab`; the class most parameters share is `embed`
    (the residual stream); a parameter class that meets, in one tensor, a class
    occurring twice in one tensor is `sequence` (attention scores over query x
    key positions); a parameter class meeting a sequence class there is
    `heads`; a class feeding heads through a repeat is `kv_heads`; the other
    classes of head parameters are `head_dim`; the leading class of a
    stacked (rank >= 3) parameter that no contraction sums over is `experts`;
    a parameter class that a forward contraction sums over is `mlp`; the rest
    `feature`.
    """
    roles: dict[int, str] = {}
    for tensor in graph.tensors:
        if (
            tensor.kind == "input"
            and tensor.dim_classes
            and tensor.dim_classes[0] is not None
        ):
            roles.setdefault(tensor.dim_classes[0], "examples")
    for event in graph.comm_events:
        if event.kind == "gather":
            for c in event.classes:
                roles.setdefault(c, "vocab")
    param_dim_counts = Counter(
        c for t in graph.params() for c in t.dim_classes if c is not None
    )
    for c, _ in param_dim_counts.most_common():
        if c not in roles:
            roles[c] = "embed"
            break
    param_classes = set(param_dim_counts)
    for tensor in graph.tensors:
        counts = Counter(c for c in tensor.dim_classes if c is not None)
        for c, n in counts.items():
            if n > 1:
                roles.setdefault(c, "sequence")
    # Attention scores: a tensor where a class repeats (query x key
    # positions); its other non-batch classes index heads.
    head_axes = set()
    for tensor in graph.tensors:
        counts = Counter(c for c in tensor.dim_classes if c is not None)
        if any(n > 1 for n in counts.values()):
            head_axes.update(c for c, n in counts.items() if n == 1 and c not in roles)
    for c in head_axes & param_classes:
        roles[c] = "heads"
    heads = head_axes
    # Classes tied to heads through reshapes or repeats: a bigger one is a
    # fused heads x head_dim dim, a smaller one feeds heads by repetition.
    for edge in graph.slice_edges:
        for end, other in ((edge.source, edge.target), (edge.target, edge.source)):
            if other in heads and end in param_classes and end not in roles:
                bigger = graph.classes[end].size > graph.classes[other].size
                roles[end] = "heads" if bigger else "kv_heads"
    for tensor in graph.params():
        classes = set(tensor.dim_classes) - {None}
        if classes & heads:
            for c in classes:
                roles.setdefault(c, "head_dim")
    contracted = {
        c
        for e in graph.comm_events
        if e.kind == "contract" and e.phase == "forward"
        for c in e.classes
    }
    # Stacked expert kernels (experts x in x out): the leading class of a
    # rank-3 parameter that no contraction sums over indexes the experts.
    for tensor in graph.params():
        if len(tensor.shape) >= 3:
            c = tensor.dim_classes[0]
            shardable = c is not None and graph.classes[c].shardable
            if shardable and c not in roles and c not in contracted:
                roles[c] = "experts"
    for c in param_classes:
        if c not in roles:
            roles[c] = "mlp" if c in contracted else "feature"
    return roles
