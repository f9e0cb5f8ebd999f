"""Name what each axis class is (batch, vocab, embed, heads, mlp, ...).

Read from the graph's structure alone, never from layer names. Roles explain a
plan; the search does not use them.
"""

from __future__ import annotations

from collections import Counter

from keras_autoshard.graph.axis_graph import AxisGraph


def class_roles(graph: AxisGraph) -> dict[int, str]:
    """Axis class id → logical role, for the classes of parameters and inputs.

    Rules, in order: the inputs' leading dim is `batch`; a dim a lookup indexes
    into a parameter is `vocab`; the class most parameters share is `embed`
    (the residual stream); a parameter class that meets, in one tensor, a class
    occurring twice there (attention scores over query × key positions) is
    `heads`; another parameter class in those tensors is `head_dim`; a
    parameter class that a contraction sums over is `mlp`; the rest `feature`.
    """
    roles: dict[int, str] = {}
    for tensor in graph.tensors:
        if (
            tensor.kind == "input"
            and tensor.dim_classes
            and tensor.dim_classes[0] is not None
        ):
            roles.setdefault(tensor.dim_classes[0], "batch")
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
        if not any(n > 1 for n in counts.values()):
            continue
        for c in counts:
            if c in param_classes and c not in roles:
                roles[c] = "heads"
    heads = {c for c, r in roles.items() if r == "heads"}
    for tensor in graph.tensors:
        classes = set(tensor.dim_classes) - {None}
        if classes & heads:
            for c in classes & param_classes:
                roles.setdefault(c, "head_dim")
    contracted = {
        c for e in graph.comm_events if e.kind == "contract" for c in e.classes
    }
    for c in param_classes:
        if c not in roles:
            roles[c] = "mlp" if c in contracted else "feature"
    return roles
