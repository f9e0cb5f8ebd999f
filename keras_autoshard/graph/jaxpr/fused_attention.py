"""cuDNN's fused attention (`jax.nn.dot_product_attention` on an NVIDIA GPU).

On a GPU, Keras's `ops.dot_product_attention` (KerasHub's attention layers
call it) runs `implementation="cudnn"`: one primitive for the forward pass,
`dot_product_attention_fwd_wrapper`, whose outputs are the attention output
and, when training, the softmax statistics (`(B, N, T)`, float32); the
backward pass is `dot_product_attention_bwd_wrapper`. Neither materializes
the `(B, N, T, S)` scores.

Axis rules (as JAX's own partitioning rule for them states): the batch and
the query heads are shared by every operand and output; the key/value heads
are cut exactly as the query heads are (grouped-query attention keeps each
device's query heads with their own key/value heads); the query sequence
goes with the output unless the mask is causal or a sliding window (then
each device would mask its block as if it began the sequence); the key
sequence and the head width are contracted inside the kernel and stay whole.
"""

from __future__ import annotations

from keras_autoshard.graph.jaxpr.registry import primitive_rule
from keras_autoshard.graph.jaxpr.walker import Eqn

FORWARD_PRIMITIVES = ("dot_product_attention_fwd_wrapper", "dot_product_attention_fwd")
BACKWARD_PRIMITIVES = ("dot_product_attention_bwd_wrapper", "dot_product_attention_bwd")
# `AttentionLayout.BNTH.value` in jax/_src/cudnn/fused_attention_stablehlo.py
# (`BTNH` is 0): heads before the sequence.
_HEADS_FIRST_LAYOUT = 1
_KERNEL = "contracted inside cuDNN's fused attention"


def _dims(e: Eqn) -> tuple[int, int, int, int]:
    """`(batch, sequence, heads, width)` dim positions of a query, key,
    value or output operand in the equation's layout."""
    if int(_layout(e)) == _HEADS_FIRST_LAYOUT:
        return 0, 2, 1, 3
    return 0, 1, 2, 3


def _layout(e: Eqn) -> int:
    layout = e.params["layout"]
    return getattr(layout, "value", layout)


def _masks_by_position(e: Eqn) -> bool:
    """Whether the kernel masks by absolute position (causal, sliding)."""
    mask_type = str(e.params.get("mask_type", ""))
    return "CAUSAL" in mask_type or e.params.get("sliding_window_length") is not None


def _tie_operands(e: Eqn, out: int, stat: int | None) -> None:
    """The axis classes of query, key, value, bias, the lengths and offsets
    (operands 0-9), tied to the output `out` (and the statistics `stat`)."""
    query, key, value, bias = e.ins[:4]
    batch, seq, heads, width = _dims(e)
    for tensor in (key, value, out):
        e.unify(query, batch, tensor, batch)
    e.unify(query, heads, out, heads)
    query_heads, kv_heads = e.shape(query)[heads], e.shape(key)[heads]
    for tensor in (key, value):
        if kv_heads == query_heads:
            e.unify(query, heads, tensor, heads)
        else:
            # Grouped heads: cut together or not at all (two slice edges).
            e.builder.add_slice_edge(
                (tensor, heads), (query, heads), "grouped heads of fused attention"
            )
            e.builder.add_slice_edge(
                (query, heads), (tensor, heads), "grouped heads of fused attention"
            )
    e.unify(key, seq, value, seq)
    if _masks_by_position(e):
        reason = "query sequence of a causal or windowed fused attention"
        e.mark(query, seq, reason)
        e.mark(out, seq, reason)
    else:
        e.unify(query, seq, out, seq)
    e.unify(value, width, out, width)
    for tensor, dim in ((query, width), (key, width), (key, seq), (value, width)):
        e.mark(tensor, dim, _KERNEL)
    e.mark(out, width, _KERNEL)
    if stat is not None:
        _tie_statistics(e, query, stat)
    _tie_bias(e, query, bias)
    for tensor in e.ins[4:10]:
        shape = e.shape(tensor)
        if len(shape) == 1 and shape[0] == e.shape(query)[batch]:
            e.unify(query, batch, tensor, 0)  # a length per sequence
        else:
            e.mark_all(tensor, "offsets or page table of a fused attention")


def _tie_statistics(e: Eqn, query: int, stat: int) -> None:
    """Softmax statistics `(B·segments, N, T)`: heads and, unmasked by
    position, the query sequence go with the query."""
    batch, seq, heads, _ = _dims(e)
    if e.shape(stat)[0] == e.shape(query)[batch]:
        e.unify(query, batch, stat, 0)
    else:
        e.mark(stat, 0, "packed segments of a fused attention")
    e.unify(query, heads, stat, 1)
    if _masks_by_position(e):
        e.mark(stat, 2, "query sequence of a causal or windowed fused attention")
    else:
        e.unify(query, seq, stat, 2)


def _tie_bias(e: Eqn, query: int, bias: int) -> None:
    """A bias (or mask) `(B | 1, N | 1, T, S)`: each dim of the query's size
    goes with it; the key sequence stays whole."""
    shape = e.shape(bias)
    if len(shape) != 4:
        e.mark_all(bias, "bias of a fused attention")
        return
    batch, seq, heads, _ = _dims(e)
    query_shape = e.shape(query)
    for bias_dim, query_dim in ((0, batch), (1, heads)):
        if shape[bias_dim] == query_shape[query_dim] and shape[bias_dim] > 1:
            e.unify(query, query_dim, bias, bias_dim)
        else:
            e.mark(bias, bias_dim, "broadcast dim of a fused attention's bias")
    if _masks_by_position(e) or shape[2] != query_shape[seq]:
        e.mark(bias, 2, "query sequence of a fused attention's bias")
    else:
        e.unify(query, seq, bias, 2)
    e.mark(bias, 3, _KERNEL)


@primitive_rule(*FORWARD_PRIMITIVES)
def _rule_attention_forward(e: Eqn) -> list[int]:
    outs = e.fresh_outputs()
    out = outs[0]
    stat = outs[1] if len(outs) > 1 else None
    _tie_operands(e, out, stat)
    key = e.ins[1]
    _, seq, _, _ = _dims(e)
    # Two products of 2·B·N·T·S·H FLOPs each: scores, then scores × values.
    for _ in range(2):
        e.event("contract", "forward", [e.element(key, seq)], out)
    return outs


@primitive_rule(*BACKWARD_PRIMITIVES)
def _rule_attention_backward(e: Eqn) -> list[int]:
    activation, forward_out, grad_out = e.ins[10:13]
    _tie_operands(e, forward_out, activation)
    e.unify_all(forward_out, grad_out)
    outs = e.fresh_outputs()
    for operand, grad in zip(e.ins[:4], outs):
        e.unify_all(operand, grad)
    return outs
